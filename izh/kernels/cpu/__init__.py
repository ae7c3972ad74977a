"""Fused CPU kernels for single-token decode steps, in C, with the torch references that define them.

A decode step of a small model on CPU is dominated by per-op dispatch (~5 us a torch op, ~35 ops a
layer). These kernels fuse the elementwise chains into one call each: `rms_norm`, `add_rms_norm_`,
`rotary_`, `silu_mul`, `paged_decode_attention` (K/V write + attention over the paged cache for a batch
of single-token decodes) and `paged_attention` (the same for any rows, prefill chunks included, each token
computed as the decode kernel computes it at that position), plus the sampler's `argmax_rows`,
`sample_rows` and `top_p_mask_`. Each has a public `*_ref` in plain torch that defines its semantics; the C kernel is used when it applies, else the
reference, so every function works everywhere.

With AVX512-BW and AVX512-BF16 (the avx512 and amx variants: `qgemm_available()`), the library also has
weight-only matmuls for 1..8 rows (1..64 where AMX runs: `qgemm_max_rows()`) over weights packed as
"records" (`pack_q4` / `pack_q8`: int4 and int8 in groups of 32, defined by `unpack_q4` / `unpack_q8` and
`q4_matmul_ref` / `q8_matmul_ref`), and `decode_stack`, which runs a whole decode step through every
decoder layer with those matmuls and the kernels above in one call (izh.model.fused_stack).

The C library is built per instruction-set variant (generic, avx2, avx512, amx; generic and neon on
aarch64), the best one this CPU runs chosen at start unless `engine.cpu_kernels` names one (or `off`),
and compiled with gcc on first use into `<model.cache_dir>/kernels`.

Every variant also multiplies float32 activations by GGUF weights in the file's own blocks (Q4_0 ... Q8_0,
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) with exact integer dot products, bit-identical to their reference in
every variant, and gathers embedding rows from them (`gguf_blocks`: `gguf_matmul`, `gguf_rows`).

Modules: `reference` (the torch references), `records` (the record format and the matmul references),
`gguf_blocks` (the GGUF block kernels, their decoder and references),
`variants` (the variants and which one a CPU runs), `compiler` (the compiler command, `build` and the cache),
`library` (loading, the variant in force, `configure` / `use_variant`), `ops` (the entry points).
"""

from izh.kernels.cpu.compiler import BuildResult, build, default_cache_dir
from izh.kernels.cpu.library import (
    CpuLibrary,
    KernelLoadError,
    available,
    configure,
    load_variant,
    qgemm_available,
    qgemm_max_rows,
    qgemm_uses_amx,
    records_f32_available,
    use_variant,
    variant,
)
from izh.kernels.cpu.ops import (
    KV_TYPES,
    STACK_FIELDS,
    STACK_GGUF,
    STACK_LORA_FIELDS,
    STACK_LORA_LINEAR,
    add_rms_norm_,
    argmax_rows,
    bf16_cache_path,
    decode_stack,
    lora_add_,
    paged_attention,
    paged_decode_attention,
    q4_matmul,
    q8_matmul,
    rms_norm,
    rotary_,
    sample_rows,
    silu_mul,
    top_p_mask_,
)
from izh.kernels.cpu.records import (
    Q4_RECORD_BYTES,
    Q8_RECORD_BYTES,
    QGEMM_GROUP,
    pack_q4,
    pack_q8,
    q4_matmul_ref,
    q4_matmul_x8_ref,
    q8_matmul_ref,
    q8_matmul_x8_ref,
    quantize_rows_x8_ref,
    unpack_q4,
    unpack_q8,
)
from izh.kernels.cpu.reference import (
    add_rms_norm_ref_,
    argmax_rows_ref,
    inverse_cdf_ref,
    paged_decode_attention_ref,
    rms_norm_ref,
    rotary_ref_,
    sample_rows_ref,
    silu_mul_ref,
)
from izh.kernels.cpu.variants import VARIANT_NAMES, runnable_variants, select_variant

__all__ = [
    "KV_TYPES",
    "Q4_RECORD_BYTES",
    "Q8_RECORD_BYTES",
    "QGEMM_GROUP",
    "STACK_FIELDS",
    "STACK_GGUF",
    "STACK_LORA_FIELDS",
    "STACK_LORA_LINEAR",
    "VARIANT_NAMES",
    "BuildResult",
    "CpuLibrary",
    "KernelLoadError",
    "add_rms_norm_",
    "add_rms_norm_ref_",
    "argmax_rows",
    "argmax_rows_ref",
    "available",
    "bf16_cache_path",
    "build",
    "configure",
    "decode_stack",
    "default_cache_dir",
    "inverse_cdf_ref",
    "load_variant",
    "lora_add_",
    "pack_q4",
    "pack_q8",
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "q4_matmul",
    "q4_matmul_ref",
    "q4_matmul_x8_ref",
    "q8_matmul",
    "q8_matmul_ref",
    "q8_matmul_x8_ref",
    "qgemm_available",
    "qgemm_max_rows",
    "qgemm_uses_amx",
    "quantize_rows_x8_ref",
    "records_f32_available",
    "rms_norm",
    "rms_norm_ref",
    "rotary_",
    "rotary_ref_",
    "runnable_variants",
    "sample_rows",
    "sample_rows_ref",
    "select_variant",
    "silu_mul",
    "silu_mul_ref",
    "top_p_mask_",
    "unpack_q4",
    "unpack_q8",
    "use_variant",
    "variant",
]
