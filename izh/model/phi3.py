"""Phi-3 / Phi-3.5 mini and Phi-4-mini: the Llama decoder with fused checkpoint projections (qkv_proj,
gate_up_proj, split here into the shards izh packs), LongRoPE scaling (izh.model.layers), where the
config sets one a sliding window over every layer (as Mistral's), and Phi-4-mini's partial rotary
(`partial_rotary_factor`, GGUF `phi3.rope.dimension_count`: RoPE over each head's first rotary_dim
dimensions, izh.model.llama.DecoderAttention) with tied embeddings."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor

from izh.model.config import ModelConfig
from izh.model.mistral import MistralForCausalLM
from izh.model.weights import CheckpointTensor


class Phi3ForCausalLM(MistralForCausalLM):
    """Phi-3 causal LM (Llama layers; the window and LongRoPE come from the config)."""


def phi3_checkpoint_tensors(
    tensors: list[CheckpointTensor], config: ModelConfig
) -> Iterator[CheckpointTensor]:
    """A Phi-3 checkpoint under Llama's names: each fused qkv_proj / gate_up_proj split by rows."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    splits = {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", 0, q),
            ("self_attn.k_proj", q, q + kv),
            ("self_attn.v_proj", q + kv, q + 2 * kv),
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, 2 * inter)),
    }
    for t in tensors:
        prefix, _, leaf = t.name.rpartition(".")
        fused = next((key for key in splits if prefix.endswith(key)), None)
        if fused is None:
            yield t
            continue
        base = prefix[: -len(fused)]
        for name, start, end in splits[fused]:
            yield CheckpointTensor(
                name=f"{base}{name}.{leaf}",
                shape=(end - start, *t.shape[1:]),
                source=f"{t.source} rows {start}:{end}",
                read=_rows(t, start, end),
            )


def _rows(t: CheckpointTensor, start: int, end: int) -> Callable[[], Tensor]:
    read = t.read
    return lambda: read()[start:end]
