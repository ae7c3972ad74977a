"""Models, attention backends and weight loading (pure nn: knows no requests, imports no engine)."""

from __future__ import annotations

from izh.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedTorchAttentionBackend,
    ReferenceAttentionBackend,
)
from izh.model.config import ModelConfig
from izh.model.loader import load_model, load_model_config

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ModelConfig",
    "PagedTorchAttentionBackend",
    "ReferenceAttentionBackend",
    "load_model",
    "load_model_config",
]
