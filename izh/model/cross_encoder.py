"""Cross-encoders (rerankers): a BERT-style encoder with a sequence-classification head, as
sentence-transformers' CrossEncoder runs them.

A (query, document) pair is one sequence (`[CLS] query [SEP] document [SEP]` for BERT, token type 1
from the document on; `<s> query </s></s> document </s>` for XLM-RoBERTa, type 0 throughout); the
head reads its first token's final hidden state:

- `BertForSequenceClassification`: transformers' pooler (dense, tanh), then `classifier` (a linear to
  num_labels);
- `XLMRobertaForSequenceClassification`: RoBERTa's classification head (`classifier.dense`, tanh,
  `classifier.out_proj`); positions start past the padding index (izh.model.bert).

Module and parameter names are transformers', under the encoder's (BertModel's) names: the loader
strips the `bert.` / `roberta.` prefix. izh serves single-label models (one relevance score per pair;
izh.model.config refuses others at load). `resolve_score_activation` reads the activation
CrossEncoder.predict applies to the logit, from the model's files, by sentence-transformers' rules.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from izh.errors import ModelLoadError
from izh.model.bert import BertModel
from izh.model.config import ModelConfig
from izh.model.layers import Linear

logger = logging.getLogger(__name__)

SCORE_ACTIVATIONS = ("sigmoid", "identity", "tanh")
"""The activations izh applies to a cross-encoder's logit (torch.nn's Sigmoid, Identity, Tanh)."""

_TORCH_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}
_ST_TRANSFORMER_TYPES = (
    "sentence_transformers.base.modules.Transformer",
    "sentence_transformers.base.modules.transformer.Transformer",
    "sentence_transformers.models.Transformer",
)


class _Dense(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(in_features, (out_features,), bias=True, dtype=dtype)


class _RobertaHead(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.dense = Linear(h, (h,), bias=True, dtype=dtype)
        self.out_proj = Linear(h, (config.num_labels,), bias=True, dtype=dtype)


class BertForSequenceClassification(BertModel):
    """BERT and its pooler + classifier: `score` gives each sequence's logits."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype=dtype)
        self.pooler = _Dense(config.hidden_size, config.hidden_size, dtype=dtype)
        self.classifier = Linear(config.hidden_size, (config.num_labels,), bias=True, dtype=dtype)

    def score(self, first_token_states: Tensor) -> Tensor:
        """Logits [num_seqs, num_labels] from each sequence's first token's state [num_seqs, hidden]."""
        pooled = torch.tanh(self.pooler.dense(first_token_states))
        return self.classifier(pooled)


class XLMRobertaForSequenceClassification(BertModel):
    """XLM-RoBERTa (a BERT with offset positions) and RoBERTa's classification head."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype=dtype)
        self.classifier = _RobertaHead(config, dtype=dtype)

    def score(self, first_token_states: Tensor) -> Tensor:
        """Logits [num_seqs, num_labels] from each sequence's first token's state [num_seqs, hidden]."""
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(first_token_states)))


CrossEncoderModel = BertForSequenceClassification | XLMRobertaForSequenceClassification


def apply_score_activation(logits: Tensor, activation: str) -> Tensor:
    """The model's activation over float32 logits (one of SCORE_ACTIVATIONS)."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "tanh":
        return torch.tanh(logits)
    return logits


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _activation_path(folder: Path, config: dict[str, Any]) -> str | None:
    """Where sentence-transformers finds a CrossEncoder's activation, in its order: a modules.json
    folder's config_sentence_transformers.json, then config.json's `sentence_transformers` block, then
    the pre-v4 `sbert_ce_default_activation_function`."""
    if (folder / "modules.json").is_file():
        modules = _read_json(folder / "modules.json")
        if not isinstance(modules, list):
            raise ModelLoadError(f"{folder}/modules.json is not a list of modules")
        others = [
            m.get("type")
            for m in modules
            if isinstance(m, dict) and m.get("type") not in _ST_TRANSFORMER_TYPES
        ]
        if others:
            raise ModelLoadError(
                f"{folder}/modules.json has modules izh does not run for a cross-encoder: {others} "
                "(izh runs the transformer and its classification head only)"
            )
        st_config_path = folder / "config_sentence_transformers.json"
        if st_config_path.is_file():
            st_config = _read_json(st_config_path)
            if st_config.get("default_prompt_name"):
                raise ModelLoadError(
                    f"{st_config_path} names a default prompt, which izh does not prepend to the query"
                )
            value = st_config.get("activation_fn")
            if isinstance(value, str):
                return value
    block = config.get("sentence_transformers")
    if isinstance(block, dict) and isinstance(block.get("activation_fn"), str):
        return str(block["activation_fn"])
    legacy = config.get("sbert_ce_default_activation_function")
    return legacy if isinstance(legacy, str) else None


def resolve_score_activation(model_path: str, num_labels: int) -> str:
    """The activation (SCORE_ACTIVATIONS) sentence-transformers' CrossEncoder.predict applies to the
    model at `model_path`: the one its files name (a `torch.` class; another module path is not
    trusted there without trust_remote_code, so its default applies), else sigmoid for one label and
    identity for more. A torch activation izh does not implement is a ModelLoadError."""
    folder = Path(model_path)
    default = "sigmoid" if num_labels == 1 else "identity"
    if not folder.is_dir():
        return default
    config = _read_json(folder / "config.json")
    path = _activation_path(folder, config if isinstance(config, dict) else {})
    if path is None:
        return default
    if not path.startswith("torch."):
        logger.warning(
            "%s names the activation %r, which sentence-transformers runs only with trust_remote_code; "
            "izh applies the default (%s), as sentence-transformers does without it",
            model_path,
            path,
            default,
        )
        return default
    activation = _TORCH_ACTIVATIONS.get(path.rsplit(".", 1)[-1])
    if activation is None:
        raise ModelLoadError(
            f"{model_path}: the cross-encoder's activation {path!r} is not supported "
            f"(izh applies torch's {', '.join(_TORCH_ACTIVATIONS)})"
        )
    return activation


def score_rows(model: CrossEncoderModel, hidden: Tensor, starts: list[int], activation: str) -> list[bytes]:
    """Each pair's score as little-endian float32 bytes (num_labels values): the head over the final
    hidden state of the pair's first row (`starts`, rows of `hidden` [num_tokens, hidden_size]), then
    `activation`, in float32 as CrossEncoder.predict upcasts."""
    index = torch.tensor(starts, dtype=torch.long, device=hidden.device)
    logits = model.score(hidden.index_select(0, index)).float()  # [num_pairs, num_labels]
    scores = apply_score_activation(logits, activation).cpu()
    return [row.numpy().astype("<f4", copy=False).tobytes() for row in scores]


def pair_token_types(num_tokens: int, segments: list[tuple[int, int]], device: torch.device) -> Tensor:
    """token_type_ids [num_tokens]: 0, and 1 over each (first row, end row) of a pair's second segment."""
    types = torch.zeros(num_tokens, dtype=torch.long)
    for start, end in segments:
        types[start:end] = 1
    return types.to(device)
