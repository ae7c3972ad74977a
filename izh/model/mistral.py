"""Mistral: the Llama decoder, with every layer attending through a sliding window when the config sets
one (Mistral 7B v0.1: 4096 keys; later Mistral models set none and run exactly as Llama)."""

from __future__ import annotations

import torch
from torch import Tensor

from izh.model.attention import AttentionMetadata
from izh.model.config import ModelConfig
from izh.model.llama import LlamaForCausalLM
from izh.model.sliding_window import KVCacheLayout, WindowedBackend


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window over all layers (izh.model.sliding_window)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype=dtype)
        self.windowed = WindowedBackend(config.sliding_window) if config.sliding_window else None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn_metadata: AttentionMetadata,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        windowed = self.windowed
        if windowed is None:
            return super().forward(input_ids, positions, attn_metadata, inputs_embeds)
        windowed.inner = self.paged_backend if self._kv_caches_bound else self.reference_backend
        cos_sin = self.rotary_emb(positions)
        return self.model(input_ids, cos_sin, attn_metadata, windowed, inputs_embeds)

    def kv_cache_layout(self) -> KVCacheLayout:
        """One group: every layer sees the window (when the config sets one)."""
        return KVCacheLayout.single(len(self.model.layers), self.config.sliding_window)

    def prepare_fused_decode(self) -> bool:
        """The fused C stack attends over the whole context: only without a window."""
        if self.windowed is not None:
            self.fused_stack = None
            return False
        return super().prepare_fused_decode()
