"""EngineConfig: the frozen, resolved configuration the engine core needs (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine core needs to start; made once by izh.settings and sent to the core."""

    model: str
    """A local GGUF file or Hugging Face folder (already resolved; never a bare model name)."""
    served_model_name: str = "model"
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16; auto is bfloat16 on CUDA, and on CPU bfloat16 for a
    quantized GGUF when the CPU has native bfloat16 (AVX512-BF16 / AMX), float32 otherwise."""
    quantization: str = "auto"
    """auto | none | int4 | int8: weight-only packed matmuls for small CPU batches (bfloat16 only); auto
    packs what a GGUF stores quantized, int4 / int8 pack every linear."""
    device: str = "auto"
    """auto | cpu | cuda."""
    max_model_len: int | None = None
    """Context length; None takes the model's own."""
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes; None derives it from kv_cache_memory_fraction."""
    kv_cache_memory_fraction: float = 0.25
    """Fraction of free memory (device memory on GPU) given to the KV cache when no byte size is set
    (on CPU at most 4 GiB)."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    """fcfs | priority."""
    seed: int = 0
    num_threads: int | None = None
    """torch intra-op threads on CPU; None keeps torch's default."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    attention_backend: str = "auto"
    """auto | torch_paged | triton_paged: auto takes Triton on CUDA (when installed), torch elsewhere."""
