"""Qwen3: the Llama decoder with per-head RMSNorm on q and k, and an explicit head_dim."""

from __future__ import annotations

import torch

from izh.errors import ModelLoadError
from izh.model.config import ModelConfig
from izh.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) causal LM: q_norm/k_norm before RoPE; head_dim need not be hidden / heads."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        if not config.qk_norm:
            raise ModelLoadError("a Qwen3 model needs qk_norm=True (q_norm/k_norm weights)")
        super().__init__(config, dtype=dtype)
