"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (never on o_proj)."""

from __future__ import annotations

from izh.model.config import ModelConfig
from izh.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM; differs from Llama only in where the attention biases are."""

    @staticmethod
    def attention_biases(config: ModelConfig) -> tuple[bool, bool]:
        # transformers' Qwen2Attention: bias=True on q/k/v whatever the config says, none on o_proj.
        return True, False
