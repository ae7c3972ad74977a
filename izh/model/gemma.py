"""Gemma 2 and Gemma 3 text decoders, on the Llama decoder's pieces.

What differs from Llama: the embeddings are scaled by sqrt(hidden_size); every norm is RMSNorm with
(1 + weight) (folded into the weight at load: GGUF files store 1 + w already, HF checkpoints get +1 in
`gemma_checkpoint_tensors`); four norms per layer (before and after attention and MLP, the "after"
ones applied to the branch output before the residual add); the MLP is GeGLU (gelu tanh); the
query scale is query_pre_attn_scalar**-0.5; sliding-window and global layers alternate. Gemma 2
soft-caps attention scores and logits; Gemma 3 has per-head q/k norms and a separate RoPE base for
its local layers.

Attention goes through izh.model.sliding_window's WindowedBackend: the C paged kernel with the window
and the soft-cap on a CPU, elsewhere the engine's backend whenever that is exact, else a torch path reading only the
window's slots. The sliding and global layers keep their KV in separate cache groups
(`KVCacheLayout.for_layers`), so the engine frees the sliding layers' blocks past their window.

On a CPU in float32 the GeGLU and the q/k norms run izh's C kernels (`gelu_tanh_mul`, `rms_norm_heads_`),
and a decode step runs Gemma's own fused C decode stack (izh.model.gemma_stack: the same kernels in one
call, bit-identical to these modules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import Tensor, nn

from izh.kernels.cpu.gemma import gelu_tanh_mul, rms_norm_heads_
from izh.model.attention import AttentionBackend, AttentionMetadata
from izh.model.config import ModelConfig
from izh.model.gemma_stack import GemmaDecodeStack, GemmaStackLayer
from izh.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, VocabEmbedding, apply_rotary_
from izh.model.llama import DecoderAttention, LlamaForCausalLM
from izh.model.sliding_window import KVCacheLayout, WindowedBackend
from izh.model.weights import CheckpointTensor


class GeGLUMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up packed in one matmul."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gelu_tanh_mul(self.gate_up_proj(x)))


class GemmaAttention(DecoderAttention):
    """DecoderAttention with Gemma's query scale, an optional sliding window and score soft-capping."""

    def __init__(self, config: ModelConfig, *, sliding: bool, dtype: torch.dtype) -> None:
        super().__init__(config, qkv_bias=config.attention_bias, o_bias=config.attention_bias, dtype=dtype)
        self.scale = config.query_pre_attn_scalar**-0.5 if config.query_pre_attn_scalar else self.scale
        self.sliding_window = config.sliding_window if sliding else None
        self.softcap = config.attn_logit_softcapping
        self.window_backend = WindowedBackend(self.sliding_window, self.softcap)

    def forward(
        self,
        hidden_states: Tensor,
        cos_sin: Tensor,
        attn_metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> Tensor:
        self.window_backend.inner = backend
        num_tokens = hidden_states.shape[0]
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden_states).view(num_tokens, h + 2 * kvh, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # In place in the fresh qkv buffer, each head as a row (the C stack's kernel).
            rms_norm_heads_(qkv[:, :h], self.q_norm.weight, self.q_norm.eps)
            rms_norm_heads_(qkv[:, h : h + kvh], self.k_norm.weight, self.k_norm.eps)
        apply_rotary_(qkv[:, : h + kvh], cos_sin)
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        out = self.window_backend.forward(q, k, v, self.kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, h * self.head_dim))


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, config: ModelConfig, *, sliding: bool, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding = sliding
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.self_attn = GemmaAttention(config, sliding=sliding, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype)

    def forward(
        self,
        hidden_states: Tensor,
        residual: Tensor | None,
        cos_sin: Tensor,
        attn_metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[Tensor, Tensor]:
        """(this block's normed MLP output, the residual stream before it), as DecoderLayer."""
        if residual is None:
            residual = hidden_states
            normed = self.input_layernorm(hidden_states)
        else:
            normed = self.input_layernorm.add_forward(hidden_states, residual)  # residual += h
        attn_out = self.post_attention_layernorm(self.self_attn(normed, cos_sin, attn_metadata, backend))
        normed = self.pre_feedforward_layernorm.add_forward(attn_out, residual)  # residual += attn
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class GemmaDecoderModel(nn.Module):
    """Scaled embedding, the layers (each with its rotary: local or global) and the final norm."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        sliding = config.sliding_layers or (False,) * config.num_hidden_layers
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, sliding=s, dtype=dtype) for s in sliding)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        # transformers rounds sqrt(hidden) to the model's dtype before multiplying.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
        self.kv_layout = KVCacheLayout.for_layers(
            [cast(GemmaDecoderLayer, layer).self_attn.sliding_window for layer in self.layers]
        )
        """Sliding-window and global layers in separate KV cache groups, so the sliding ones free the
        blocks their window has left; each layer's backend reads its group's metadata."""
        for layer, group in zip(self.layers, self.kv_layout.layer_groups, strict=True):
            cast(GemmaDecoderLayer, layer).self_attn.window_backend.kv_group = group

    def forward(
        self,
        input_ids: Tensor,
        cos_sin: tuple[Tensor, Tensor],
        attn_metadata: AttentionMetadata,
        backend: AttentionBackend,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden_states = embeds * self.embed_scale  # [num_tokens, hidden_size]
        global_cos_sin, local_cos_sin = cos_sin
        residual: Tensor | None = None
        for module in self.layers:
            layer = cast(GemmaDecoderLayer, module)
            rotary = local_cos_sin if layer.sliding else global_cos_sin
            hidden_states, residual = layer(hidden_states, residual, rotary, attn_metadata, backend)
        assert residual is not None
        return self.norm.add_forward(hidden_states, residual)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text causal LM (the config says which features are on)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype=dtype)
        self.gemma_stack: GemmaDecodeStack | None = None
        """Decode steps in one C call (`prepare_fused_decode`); None runs the modules."""
        self.local_rotary_emb = (
            RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.rope_local_theta, None, dtype=dtype
            )
            if config.rope_local_theta
            else None
        )

    def build_decoder(self, config: ModelConfig, dtype: torch.dtype) -> GemmaDecoderModel:  # type: ignore[override]
        return GemmaDecoderModel(config, dtype=dtype)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn_metadata: AttentionMetadata,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        global_cos_sin = self.rotary_emb(positions)
        local = self.local_rotary_emb
        local_cos_sin = global_cos_sin if local is None else local(positions)
        backend = self.paged_backend if self._kv_caches_bound else self.reference_backend
        model = cast(GemmaDecoderModel, self.model)
        stack = self.gemma_stack
        if (
            stack is not None
            and inputs_embeds is None
            and (self.lora is None or not self.lora.active)
            and stack.applies(input_ids, attn_metadata, backend)
        ):
            embeds = model.embed_tokens(input_ids) * model.embed_scale  # as GemmaDecoderModel scales them
            return stack.run(embeds, (global_cos_sin, local_cos_sin), attn_metadata)
        return model(input_ids, (global_cos_sin, local_cos_sin), attn_metadata, backend, inputs_embeds)

    def kv_cache_layout(self) -> KVCacheLayout:
        return cast(GemmaDecoderModel, self.model).kv_layout

    def prepare_fused_decode(self) -> bool:
        """Run decode steps through Gemma's own C stack (izh.model.gemma_stack) from now on, when this
        model can (float32 on a CPU with the C kernels, linears packed, KV caches bound); Llama's stack
        (`fused_stack`) never runs Gemma's layers."""
        self.fused_stack = None
        model = cast(GemmaDecoderModel, self.model)
        layers = []
        for module in model.layers:
            layer = cast(GemmaDecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            norms = (
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.pre_feedforward_layernorm.weight,
                layer.post_feedforward_layernorm.weight,
            )
            qk = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm and attn.k_norm else None
            layers.append(
                GemmaStackLayer(
                    norms=norms,
                    qk_norms=qk,
                    kv_cache=attn.kv_cache,
                    kv_group=attn.window_backend.kv_group,
                    window=attn.sliding_window or 0,
                    local_rope=layer.sliding,
                    linears=(attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                )
            )
        scale = cast(GemmaAttention, cast(GemmaDecoderLayer, model.layers[0]).self_attn).scale
        num_groups = len(model.kv_layout.windows)
        self.gemma_stack = GemmaDecodeStack.build(
            self.config, self.dtype, layers, model.norm.weight, scale, num_groups
        )
        return self.gemma_stack is not None

    def decode_stack_rows(self) -> int | None:
        stack = self.gemma_stack
        return None if stack is None else stack.max_tokens

    def bind_kv_caches(self, kv_caches: list[Tensor] | None) -> None:
        self.gemma_stack = None  # its table points at the old caches
        super().bind_kv_caches(kv_caches)

    def compute_logits(self, hidden_states: Tensor, out: Tensor | None = None) -> Tensor:
        logits = super().compute_logits(hidden_states, out)
        cap = self.config.final_logit_softcapping
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norms and local RoPE base (both from the config)."""


def gemma_checkpoint_tensors(tensors: list[CheckpointTensor]) -> Iterator[CheckpointTensor]:
    """A HF Gemma checkpoint with 1 added to every RMSNorm weight (Gemma computes x * (1 + w); GGUF
    files already store 1 + w, as llama.cpp's converter writes them)."""
    for t in tensors:
        if t.name.endswith("norm.weight"):
            yield CheckpointTensor(name=t.name, shape=t.shape, source=t.source, read=_plus_one(t))
        else:
            yield t


def _plus_one(t: CheckpointTensor) -> Callable[[], Tensor]:
    read = t.read
    return lambda: read().float().add(1.0)
