"""The Llama decoder (SmolLM2, Llama 3), which Qwen2 and Qwen3 reuse with their small differences.

Parameter names follow transformers' checkpoints (`model.layers.0.self_attn...`) except where projections
are packed (qkv_proj, gate_up_proj); the loader maps checkpoint names onto those rows.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from izh.kernels.kv_cache_dtype import format_of_cache
from izh.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedTorchAttentionBackend,
    ReferenceAttentionBackend,
)
from izh.model.config import ModelConfig
from izh.model.fused_stack import FusedDecodeStack, StackLayer
from izh.model.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    apply_rotary_,
)
from izh.model.lora import LoraModel
from izh.model.packed import PackedWeight
from izh.model.sliding_window import KVCacheLayout


class DecoderAttention(nn.Module):
    """Self-attention: packed qkv projection, optional per-head q/k RMSNorm, RoPE, backend, o_proj."""

    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_dim = config.rope_dim
        """RoPE rotates each head's first rope_dim dimensions (all but for a partial rotary model)."""
        self.scale = config.head_dim**-0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size,
            (q_size, kv_size, kv_size),
            bias=qkv_bias,
            dtype=dtype,
            shard_names=("q_proj", "k_proj", "v_proj"),
        )
        self.o_proj = Linear(q_size, (config.hidden_size,), bias=o_bias, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        self.kv_cache: Tensor | None = None

    def forward(
        self,
        hidden_states: Tensor,
        cos_sin: Tensor,
        attn_metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:
        num_tokens = hidden_states.shape[0]
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden_states).view(num_tokens, h + 2 * kvh, self.head_dim)
        rot = self.rope_dim
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :h])
            k = self.k_norm(qkv[:, h : h + kvh])
            apply_rotary_(q[..., :rot], cos_sin)
            apply_rotary_(k[..., :rot], cos_sin)
        else:
            # One in-place rotation of q and k together, inside the fresh qkv buffer (of each head's
            # first rope_dim dimensions: a strided view when the rotary is partial).
            apply_rotary_(qkv[:, : h + kvh, :rot], cos_sin)
            q, k = qkv[:, :h], qkv[:, h : h + kvh]
        v = qkv[:, h + kvh :]
        out = backend.forward(q, k, v, self.kv_cache, attn_metadata, self.scale)  # [num_tokens, h, d]
        return self.o_proj(out.reshape(num_tokens, h * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = DecoderAttention(config, qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype)

    def forward(
        self,
        hidden_states: Tensor,
        residual: Tensor | None,
        cos_sin: Tensor,
        attn_metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[Tensor, Tensor]:
        """(this block's MLP output, the residual stream before it): the next block (or the final
        norm) adds the two inside its norm kernel. residual None = the first block (input = stream)."""
        if residual is None:
            residual = hidden_states
            normed = self.input_layernorm(hidden_states)
        else:
            normed = self.input_layernorm.add_forward(hidden_states, residual)  # residual += h
        attn_out = self.self_attn(normed, cos_sin, attn_metadata, backend)
        normed = self.post_attention_layernorm.add_forward(attn_out, residual)  # residual += attn
        return self.mlp(normed), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm (transformers' `model.` prefix)."""

    def __init__(self, config: ModelConfig, *, qkv_bias: bool, o_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        input_ids: Tensor,
        cos_sin: Tensor,
        attn_metadata: AttentionMetadata,
        backend: AttentionBackend,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        # [num_tokens, hidden_size]; a VLM's prefill passes embeddings with its images' features merged in.
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual: Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos_sin, attn_metadata, backend)
        if residual is None:
            return self.norm(hidden_states)
        return self.norm.add_forward(hidden_states, residual)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a flat batch; the interface every izh model implements.

    Without a bound KV cache it runs the reference backend (fresh sequences only); with one, the paged
    backend (`paged_backend`, replaceable, e.g. by a Triton kernel backend).
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = self.build_decoder(config, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, (config.vocab_size,), bias=False, dtype=dtype)
        )
        self.rotary_emb = RotaryEmbedding(
            config.rope_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype=dtype,
        )
        self.packed_lm_head: PackedWeight | None = None
        """Weight-only copy of the LM head for small batches (izh.model.packing.pack_model_weights)."""
        self.reference_backend: AttentionBackend = ReferenceAttentionBackend()
        self.paged_backend: AttentionBackend = PagedTorchAttentionBackend()
        self.fused_stack: FusedDecodeStack | None = None
        """Small decode steps in one C call (`prepare_fused_decode`); None runs the modules."""
        self.lora: LoraModel | None = None
        """Resident LoRA adapters (izh.model.lora, attached by the engine): the linears' hooks add the
        deltas on the module path, the fused stack adds them itself on the decode steps it runs."""
        self._kv_caches_bound = False

    def build_decoder(self, config: ModelConfig, dtype: torch.dtype) -> DecoderModel:
        """The `model.` module (embedding, layers, final norm); a family with other layers overrides it."""
        qkv_bias, o_bias = self.attention_biases(config)
        return DecoderModel(config, qkv_bias=qkv_bias, o_bias=o_bias, dtype=dtype)

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj): transformers' Llama puts attention_bias on all four."""
        return config.attention_bias, config.attention_bias

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn_metadata: AttentionMetadata,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Final-normed hidden states [num_tokens, hidden_size] for a flat batch of token ids
        [num_tokens] int64 at absolute positions [num_tokens] int64. `inputs_embeds` [num_tokens,
        hidden_size] replaces the embedding lookup (a VLM's prefill with image features)."""
        cos_sin = self.rotary_emb(positions)  # [num_tokens, head_dim], shared by every layer
        backend = self.paged_backend if self._kv_caches_bound else self.reference_backend
        stack = self.fused_stack
        lora = self.lora if self.lora is not None and self.lora.active else None
        if (
            stack is not None
            and stack.applies(input_ids, attn_metadata, backend)
            and (lora is None or stack.lora_table(lora) is not None)
        ):
            embeds = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            return stack.run(embeds, cos_sin, attn_metadata, lora)
        return self.model(input_ids, cos_sin, attn_metadata, backend, inputs_embeds)

    def prepare_fused_decode(self) -> bool:
        """Run small decode steps through `FusedDecodeStack` from now on, when this model can (packed
        with izh's records, KV caches bound, bfloat16 on a CPU with the C kernels); returns whether it
        will. Call after packing the weights and binding the caches; binding again turns it off."""
        layers = []
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                StackLayer(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    attn.kv_cache,
                    (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                )
            )
        self.fused_stack = FusedDecodeStack.build(self.config, self.dtype, layers, self.model.norm.weight)
        return self.fused_stack is not None

    def decode_stack_rows(self) -> int | None:
        """The most single-token decodes a step runs through this model's fused C decode stack (None:
        it has none now)."""
        stack = self.fused_stack
        return None if stack is None else stack.max_tokens

    def attach_lora(self, num_slots: int, max_rank: int) -> LoraModel:
        """Give every decoder layer's linears `num_slots` LoRA slots of rank <= `max_rank` (empty)."""
        self.lora = LoraModel(list(self.model.layers), num_slots, max_rank)
        return self.lora

    def compute_logits(self, hidden_states: Tensor, out: Tensor | None = None) -> Tensor:
        """float32 logits [n, vocab_size] for hidden states [n, hidden_size].

        `out` ([>= n, vocab_size] float32) receives them when given: a buffer reused across steps spares
        the page faults of a fresh multi-MB tensor every step (5 ms vs 1 ms at 128 x 49k on a CPU).
        """
        n = hidden_states.shape[0]
        head = self.packed_lm_head
        if head is not None and n <= head.max_rows:
            if out is None:
                out = hidden_states.new_empty(n, self.config.vocab_size, dtype=torch.float32)
            return head.matmul(hidden_states, out=out)  # fp32 straight from the kernel
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden_states, weight)
        if out is None:
            return logits.float()
        return out[:n].copy_(logits)

    def attention_layers(self) -> list[DecoderAttention]:
        """The attention module of every layer, in order."""
        return [cast(DecoderAttention, layer.self_attn) for layer in self.model.layers]

    def kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache groups of this model's layers (izh.model.sliding_window): one group of full
        attention here; a model with sliding-window layers says which layers see which window."""
        return KVCacheLayout.single(len(self.model.layers))

    def bind_kv_caches(self, kv_caches: list[Tensor] | None) -> None:
        """Give each layer its cache [2, num_blocks, block_size, num_kv_heads, row] (None unbinds): the
        model's dtype with row = head_dim, or another KV cache format (izh.kernels.kv_cache_dtype: row =
        its `row_size(head_dim)`), one format for every layer.

        The caches are used in place and must hold finite values (allocate with torch.zeros).
        """
        layers = self.attention_layers()
        self.fused_stack = None  # its table points at the old caches
        if kv_caches is None:
            for attn in layers:
                attn.kv_cache = None
            self._kv_caches_bound = False
            return
        if len(kv_caches) != len(layers):
            raise ValueError(f"expected {len(layers)} KV caches (one per layer), got {len(kv_caches)}")
        storage = kv_caches[0].dtype if kv_caches else self.dtype
        try:
            fmt = format_of_cache(storage)
        except ValueError as exc:
            raise ValueError(f"KV cache 0: {exc}") from None
        for i, (attn, cache) in enumerate(zip(layers, kv_caches, strict=True)):
            row = fmt.row_size(attn.head_dim)
            if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[3:] != (attn.num_kv_heads, row):
                raise ValueError(
                    f"KV cache {i} has shape {tuple(cache.shape)}, expected "
                    f"[2, num_blocks, block_size, {attn.num_kv_heads}, {row}]"
                )
            if cache.dtype != storage or not cache.is_contiguous():
                raise ValueError(f"KV cache {i} must be a contiguous {storage} tensor, got {cache.dtype}")
        for attn, cache in zip(layers, kv_caches, strict=True):
            attn.kv_cache = cache
        self._kv_caches_bound = True
