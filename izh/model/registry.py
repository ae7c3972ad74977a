"""Which model class implements which architecture (HF `architectures` or GGUF `general.architecture`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from izh.errors import UnsupportedModel
from izh.model.attention import AttentionMetadata
from izh.model.bert import BertModel
from izh.model.config import ModelConfig
from izh.model.cross_encoder import BertForSequenceClassification, XLMRobertaForSequenceClassification
from izh.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from izh.model.idefics3 import Idefics3ForConditionalGeneration
from izh.model.llama import LlamaForCausalLM
from izh.model.mistral import MistralForCausalLM
from izh.model.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from izh.model.phi3 import Phi3ForCausalLM
from izh.model.qwen2 import Qwen2ForCausalLM
from izh.model.qwen3 import Qwen3ForCausalLM


class CausalLM(Protocol):
    """What the model runner relies on; every registered class is an nn.Module with these methods."""

    config: ModelConfig

    def forward(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata) -> Tensor: ...

    def compute_logits(self, hidden_states: Tensor) -> Tensor: ...

    def bind_kv_caches(self, kv_caches: list[Tensor] | None) -> None: ...


MODEL_REGISTRY: dict[str, type[LlamaForCausalLM] | type[BertModel]] = {
    # Hugging Face config.json `architectures`
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # GGUF `general.architecture`, also ModelConfig.architecture
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "bert": BertModel,
    "bert_classifier": BertForSequenceClassification,
    "xlm_roberta_classifier": XLMRobertaForSequenceClassification,
    "idefics3": Idefics3ForConditionalGeneration,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "mistral": MistralForCausalLM,
    "phi3": Phi3ForCausalLM,
    # Mixture of experts (izh.model.moe). GGUF: qwen3moe; a Mixtral GGUF is "llama" with experts, which
    # ModelConfig names "mixtral".
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "qwen3moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM] | type[BertModel]:
    """The class for an architecture name; an unknown one raises ModelLoadError listing the supported."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnsupportedModel(
            f"unsupported model architecture {architecture!r} (supported: {', '.join(MODEL_REGISTRY)})"
        ) from None


def build_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM | BertModel:
    """An uninitialized model (parameters allocated, not loaded) on the current default device."""
    return get_model_class(config.architecture)(config, dtype=dtype)
