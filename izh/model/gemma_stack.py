"""Gemma 2 / Gemma 3 decode steps through the whole decoder stack in C (float32): one
`izh.kernels.cpu.gemma.gemma_decode_stack` call per step, any number of single-token decodes.

Gemma's layer is not Llama's (four norms, GeGLU, q/k norms, local and global RoPE, a sliding window and a
KV cache group per layer), so it has a stack of its own (csrc/gemma_stack.c) beside
izh.model.fused_stack's. It runs the C kernels the modules run (izh.model.gemma: packed records or GGUF
blocks, `gelu_tanh_mul`, `rms_norm_heads_`, the paged attention with the layer's window) in their order, so
its output is bit-identical to theirs; it skips the ~15 Python calls a layer makes between them (on
Gemma 3 270M's 18 layers, a few milliseconds of a 1-stream decode step). Prefills, mixed steps, LoRA
steps and anything not float32 on a CPU run the modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from izh.kernels.cpu.gemma import GEMMA_STACK_FIELDS, gemma_available, gemma_decode_stack
from izh.kernels.cpu.ops import KV_TYPES
from izh.model.attention import AttentionMetadata, PagedTorchAttentionBackend
from izh.model.config import ModelConfig
from izh.model.fused_stack import linear_fields
from izh.model.layers import Linear
from izh.model.packed import RECORDS_ANY_ROWS


@dataclass(frozen=True, slots=True)
class GemmaStackLayer:
    """What the stack reads of one Gemma decoder layer (izh.model.gemma assembles these)."""

    norms: tuple[Tensor, Tensor, Tensor, Tensor]
    """input, post-attention, pre-feedforward and post-feedforward RMSNorm weights (1 + w folded in)."""
    qk_norms: tuple[Tensor, Tensor] | None
    """Gemma 3's per-head q and k norm weights; None (Gemma 2) skips them."""
    kv_cache: Tensor | None
    kv_group: int
    window: int
    """The sliding window (0: a global layer)."""
    local_rope: bool
    """The layer rotates with the local RoPE base (Gemma 3's sliding layers)."""
    linears: tuple[Linear, Linear, Linear, Linear]
    """qkv_proj, o_proj, gate_up_proj, down_proj."""


class GemmaDecodeStack:
    """The pointer table of a Gemma model's layers for `gemma_decode_stack`.

    Holds raw pointers: build it after the weights are packed and the KV caches bound, and drop it when
    either changes (`Gemma2ForCausalLM.bind_kv_caches` does)."""

    max_tokens = RECORDS_ANY_ROWS
    """Decodes per step it takes: any number (float32 matmuls take any row count)."""

    def __init__(
        self,
        config: ModelConfig,
        table: Tensor,
        final_norm: Tensor,
        scale: float,
        num_groups: int,
        kv_geometry: tuple[int, int, int],
        keep: list[Tensor],
    ) -> None:
        self.table = table
        self.dims = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
        )
        self.eps = config.rms_norm_eps
        self.scale = scale
        self.softcap = float(config.attn_logit_softcapping or 0.0)
        self.final_norm = final_norm
        self.num_groups = num_groups
        self.kv_geometry = kv_geometry
        self._keep = keep
        """The GGUF linears' part tables the table points at."""

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        layers: Sequence[GemmaStackLayer],
        final_norm: Tensor,
        scale: float,
        num_groups: int,
    ) -> GemmaDecodeStack | None:
        """The stack for `layers` (in order), or None when it cannot run: not float32, no C library here,
        a partial rotary, a linear without packed records or GGUF blocks, a weight that is not a contiguous
        float32 CPU tensor, a KV cache that is not a contiguous CPU tensor of an `engine.kv_cache_dtype`
        format (every layer's the same; the attention converts as it writes and reads, as the modules' does)."""
        if dtype != torch.float32 or not gemma_available() or config.rope_dim != config.head_dim:
            return None
        rows: list[list[int]] = []
        keep: list[Tensor] = []
        geometry: tuple[int, int, int] | None = None
        for layer in layers:
            cache = layer.kv_cache
            weights = [*layer.norms, *(layer.qk_norms or ())]
            if cache is None or not all(_usable(t) for t in weights):
                return None
            if cache.dtype not in KV_TYPES or not cache.is_cpu or not cache.is_contiguous():
                return None
            shape = (int(cache.shape[1]), int(cache.shape[2]), KV_TYPES[cache.dtype])
            if geometry not in (None, shape) or not 0 <= layer.kv_group < num_groups:
                return None
            geometry = shape
            q_norm, k_norm = (t.data_ptr() for t in layer.qk_norms) if layer.qk_norms else (0, 0)
            row = [t.data_ptr() for t in layer.norms]
            row += [q_norm, k_norm, cache.data_ptr(), layer.kv_group, layer.window, int(layer.local_rope)]
            for linear in layer.linears:
                fields = linear_fields(linear, dtype, keep)
                if fields is None:
                    return None
                row.extend(fields)
            rows.append(row)
        if geometry is None or not _usable(final_norm):
            return None
        table = torch.tensor(rows, dtype=torch.int64)
        assert table.shape[1] == GEMMA_STACK_FIELDS
        return cls(config, table, final_norm, scale, num_groups, geometry, keep)

    @staticmethod
    def applies(input_ids: Tensor, attn_metadata: AttentionMetadata, backend: object) -> bool:
        """This step is single-token decodes only, through the paged CPU backend."""
        return (
            attn_metadata.max_query_len == 1
            and type(backend) is PagedTorchAttentionBackend
            and input_ids.is_cpu
        )

    def run(
        self, hidden_states: Tensor, cos_sin: tuple[Tensor, Tensor], attn_metadata: AttentionMetadata
    ) -> Tensor:
        """Final-normed hidden states for the scaled embeddings `hidden_states` [M, hidden] (overwritten);
        cos_sin: the (global, local) RoPE rows [M, head_dim]."""
        groups = attn_metadata.groups or (attn_metadata,) * self.num_groups
        if len(groups) != self.num_groups:
            raise ValueError(f"the step has {len(groups)} KV cache groups, the model {self.num_groups}")
        keep: list[Tensor] = []
        rows = []
        for meta in groups:
            slots = _as(meta.slot_mapping, torch.int64)
            tables = _as(meta.block_tables, torch.int32)
            keep += [slots, tables]
            rows.append([slots.data_ptr(), tables.data_ptr(), int(tables.shape[1])])
        return gemma_decode_stack(
            self.table,
            self.dims,
            self.eps,
            self.scale,
            self.softcap,
            hidden_states,
            self.final_norm,
            cos_sin,
            torch.tensor(rows, dtype=torch.int64),
            _as(attn_metadata.seq_lens, torch.int32),
            self.kv_geometry,
        )


def _usable(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
