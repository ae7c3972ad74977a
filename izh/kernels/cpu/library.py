"""Loading the C kernels: the ctypes bindings, the variant in force, and switching it.

The wrappers in izh.kernels.cpu (ops.py) call through the *active* library, resolved once, on the first
call that needs it (thread-safe; never raises): the variant `engine.cpu_kernels` asks for (auto, the
default: the best this CPU runs, izh.kernels.cpu.variants), built or taken from the cache
(izh.kernels.cpu.compiler) and loaded with ctypes. One INFO line says which variant runs and why
(`izh CPU kernels: avx2 (this CPU has avx2 fma f16c, no avx512f)`). `off` loads nothing; a missing
compiler or a failed build logs one warning and leaves the torch references in charge.

The engine calls `configure(variant, cache_dir)` once before it loads a model (from its settings; a
forced variant this CPU cannot run is a ModelLoadError there). Code with no settings (the offline LLM,
tests) gets the environment's values (`izh.settings.env_cpu_kernels`, `env_cache_dir`).

Each variant is its own library file, so several can be loaded in one process: `load_variant(name)`
returns one as a `CpuLibrary`, and `use_variant(name)` makes the module-level wrappers use it inside a
`with` block (tests run every runnable variant against the references that way). Two loaded variants do
not see each other's symbols: ctypes loads with RTLD_LOCAL, so each library's calls between its own
files bind to itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from izh.errors import ModelLoadError
from izh.kernels.cpu.compiler import build, default_cache_dir
from izh.kernels.cpu.variants import select_variant

__all__ = [
    "NO_LIBRARY",
    "CpuLibrary",
    "KernelLoadError",
    "available",
    "configure",
    "load_variant",
    "qgemm_available",
    "qgemm_max_rows",
    "qgemm_uses_amx",
    "records_f32_available",
    "resolve",
    "use_variant",
    "variant",
]

logger = logging.getLogger(__name__)

_ABI_VERSION = 10  # izh_cpu_abi_version() in csrc/abi.c
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# the paged attention kernels' leading arguments (q .. v with their strides, the cache, its kv type,
# num_blocks, block_size, kvh, slot_mapping, block_tables, max_blocks) and trailing ones (out, n, H, d,
# scale, nt)
_ATTN_HEAD = [*(_P, _I64, _I64) * 3, _P, _INT, _I64, _I64, _I64, _P, _P, _I64]
_ATTN_TAIL = [_P, _I64, _I64, _I64, _F32, _INT]
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # x, x_stride, w, out, n, hidden, eps, nt
    "rms_norm": (None, [_P, _I64, _P, _P, _I64, _I64, _F32, _INT]),
    # x, residual, w, out, n, hidden, eps, nt
    "add_rms_norm": (None, [_P, _P, _P, _P, _I64, _I64, _F32, _INT]),
    # x, token_stride, head_stride, cos_sin, n, heads, head_dim, nt
    "rotary": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _INT]),
    # gate_up, row_stride, out, n, intermediate, nt
    "silu_mul": (None, [_P, _I64, _P, _I64, _I64, _INT]),
    # q, q_ts, q_hs, k, k_ts, k_hs, v, v_ts, v_hs, kv_cache, kv_type, num_blocks, block_size, kvh,
    # slot_mapping, block_tables, max_blocks, seq_lens, window, softcap, out, n, H, d, scale, nt
    "paged_decode_attention": (_INT, [*_ATTN_HEAD, _P, _I64, _F32, *_ATTN_TAIL]),
    # as paged_decode_attention, with row_seq and num_seqs after max_blocks
    "paged_attention": (_INT, [*_ATTN_HEAD, _P, _I64, _P, _I64, _F32, *_ATTN_TAIL]),
}


class KernelLoadError(RuntimeError):
    """A variant's library cannot be built or loaded; the message says why."""


class _Kernels(NamedTuple):
    rms_norm: Any
    add_rms_norm: Any
    rotary: Any
    silu_mul: Any
    paged_decode_attention: Any
    paged_attention: Any


@dataclass(frozen=True, slots=True, eq=False)
class CpuLibrary:
    """One loaded variant with its functions bound, or none (`NO_LIBRARY`: the torch fallbacks run).

    `kernels` by dtype (float32, bfloat16); `sampling` (argmax, sample, top-p) when loaded; `qgemm` (q4,
    q8, decode stack, uses-AMX) only in the AVX512-BF16 builds, whose matmuls take up to
    `qgemm_max_rows` rows (64 where AMX runs, else 8)."""

    variant: str | None
    path: Path | None = None
    kernels: dict[torch.dtype, _Kernels] = field(default_factory=dict)
    sampling: tuple[Any, ...] = ()
    qgemm: tuple[Any, ...] = ()
    qgemm_max_rows: int = 0
    records_f32: tuple[Any, ...] = ()
    """(q4, q8, decode stack) over records with float32 activations: every variant has them."""
    lora_f32: Any = None
    """`izh_lora_add_f32` (csrc/lora.c): float32 LoRA deltas of a linear's rows, as the decode stack adds
    them."""
    handle: ctypes.CDLL | None = None  # keeps the library mapped


NO_LIBRARY = CpuLibrary(None)


def _bind(lib: ctypes.CDLL, suffix: str) -> _Kernels:
    funcs = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, f"izh_{name}_{suffix}")
        fn.restype = restype
        fn.argtypes = argtypes
        funcs[name] = fn
    return _Kernels(**funcs)


def _bind_library(name: str, path: Path) -> CpuLibrary:
    try:
        lib = ctypes.CDLL(str(path))
        lib.izh_cpu_abi_version.restype = ctypes.c_int
        if lib.izh_cpu_abi_version() != _ABI_VERSION:
            raise OSError(f"ABI version {lib.izh_cpu_abi_version()} != {_ABI_VERSION}")
        kernels = {torch.float32: _bind(lib, "f32"), torch.bfloat16: _bind(lib, "bf16")}
        lib.izh_argmax_rows_f32.restype = None
        lib.izh_argmax_rows_f32.argtypes = [_P, _I64, _I64, _I64, _P, _INT]
        lib.izh_sample_rows_f32.restype = _INT
        lib.izh_sample_rows_f32.argtypes = [_P, _I64, _I64, _I64, _P, _P, _INT]
        lib.izh_top_p_rows_f32.restype = _INT
        lib.izh_top_p_rows_f32.argtypes = [_P, _I64, _I64, _I64, _P, _INT]
        sampling = (lib.izh_argmax_rows_f32, lib.izh_sample_rows_f32, lib.izh_top_p_rows_f32)
        qgemm: tuple[Any, ...] = ()
        max_rows = 0
        lib.izh_qgemm_available.restype = ctypes.c_int
        if lib.izh_qgemm_available():
            for fn_name in ("izh_q4_gemm", "izh_q8_gemm"):
                fn = getattr(lib, fn_name)
                fn.restype = _INT
                fn.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _P, _I64, _INT, _INT]
            stack = lib.izh_decode_stack_bf16
            stack.restype = _INT
            stack.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _P, _P, _P, _P]
            stack.argtypes += [_P, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT]
            lib.izh_qgemm_max_rows.restype = _INT
            lib.izh_qgemm_uses_amx.restype = _INT
            lib.izh_qgemm_uses_amx.argtypes = [_INT, _I64]
            qgemm = (lib.izh_q4_gemm, lib.izh_q8_gemm, stack, lib.izh_qgemm_uses_amx)
            max_rows = int(lib.izh_qgemm_max_rows())
        for fn_name in ("izh_q4_gemm_f32", "izh_q8_gemm_f32"):
            fn = getattr(lib, fn_name)
            fn.restype = _INT
            fn.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _P, _I64, _INT]
        stack_f32 = lib.izh_decode_stack_f32
        stack_f32.restype = _INT
        stack_f32.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _P, _P, _P, _P]
        stack_f32.argtypes += [_P, _P, _I64, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _INT]
        records_f32 = (lib.izh_q4_gemm_f32, lib.izh_q8_gemm_f32, stack_f32)
        lora_f32 = lib.izh_lora_add_f32
        lora_f32.restype = _INT
        lora_f32.argtypes = [_P, _I64, _I64, _P, _I64, _P, _I64, _P, _P, _INT]
    except (OSError, AttributeError) as exc:
        raise KernelLoadError(f"cannot load {path}: {exc}") from exc
    return CpuLibrary(name, path, kernels, sampling, qgemm, max_rows, records_f32, lora_f32, lib)


@dataclass(slots=True)
class _State:
    """The process's kernel state: what is asked for, and the library the wrappers call."""

    active: CpuLibrary | None = None
    """The library in force (NO_LIBRARY for the torch fallbacks); None until the first use resolves it."""
    requested: str | None = None
    """auto | off | a variant name; None: the environment's (env_cpu_kernels), until `configure`."""
    kernels_dir: Path | None = None
    """Where the libraries are cached; None: `default_cache_dir()`, until `configure`."""
    loaded: dict[Path, CpuLibrary] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


STATE = _State()


def configure(variant: str | None = None, cache_dir: Path | str | None = None) -> None:
    """Set the variant for the library loaded on first use, and where it is cached.

    variant: auto | off | generic | avx2 | avx512 | amx | neon (`engine.cpu_kernels`); None takes the
    environment's (IZH_ENGINE__CPU_KERNELS, IZH_CPU_KERNELS, else auto). cache_dir: `model.cache_dir`,
    the libraries going to `<cache_dir>/kernels`; None takes the environment's. A change of either drops
    the active library (the next call resolves again). Raises ModelLoadError for a variant this CPU
    cannot run, naming the flags it lacks."""
    from izh.settings import env_cache_dir, env_cpu_kernels

    requested = (variant if variant is not None else env_cpu_kernels()).strip().lower()
    if requested not in ("auto", "off"):
        try:
            select_variant(requested)
        except ValueError as exc:
            raise ModelLoadError(f"engine.cpu_kernels = {requested}: {exc}") from None
    base = Path(cache_dir) if cache_dir is not None else env_cache_dir()
    kernels_dir = base.expanduser() / "kernels"
    with STATE.lock:
        if (requested, kernels_dir) != (STATE.requested, STATE.kernels_dir):
            STATE.requested, STATE.kernels_dir = requested, kernels_dir
            STATE.active = None


def load_variant(name: str, kernels_dir: Path | str | None = None) -> CpuLibrary:
    """Build (or reuse) and load variant `name` as its own library, whatever variant is in force.

    kernels_dir defaults to the configured folder (`<model.cache_dir>/kernels`). Raises ValueError when
    this CPU cannot run the variant, KernelLoadError when it cannot be built or loaded."""
    select_variant(name)  # raises for an unknown name, another machine's or a missing flag
    with STATE.lock:
        folder = kernels_dir if kernels_dir is not None else STATE.kernels_dir or default_cache_dir()
        result = build(folder, variant=name)
        if result.path is None:
            raise KernelLoadError(result.error or "no library")
        if result.compiled:
            logger.info("compiled izh CPU kernels (%s) in %.2f s: %s", name, result.seconds, result.path)
        lib = STATE.loaded.get(result.path)
        if lib is None:
            lib = STATE.loaded[result.path] = _bind_library(name, result.path)
        return lib


def _load_requested() -> CpuLibrary:
    """The library `STATE.requested` asks for, or NO_LIBRARY after one log line saying why not."""
    requested = STATE.requested
    if requested is None:
        from izh.settings import env_cpu_kernels

        requested = env_cpu_kernels()
    if requested == "off":
        logger.info("izh CPU kernels: off (engine.cpu_kernels = off): the torch fallbacks run")
        return NO_LIBRARY
    selection = select_variant(requested)
    lib = load_variant(selection.variant)
    logger.info("izh CPU kernels: %s (%s)", selection.variant, selection.reason)
    return lib


def resolve() -> CpuLibrary:
    """The active library, loading it on the first call (thread-safe; never raises)."""
    with STATE.lock:
        if STATE.active is None:
            try:
                STATE.active = _load_requested()
            except Exception as exc:  # never let a build problem escape into a forward pass
                logger.warning("izh CPU kernels unavailable, using the torch fallbacks: %s", exc)
                STATE.active = NO_LIBRARY
        return STATE.active


@contextlib.contextmanager
def use_variant(name: str | None) -> Iterator[CpuLibrary]:
    """Inside the block, the module-level wrappers (and `variant()`, `qgemm_available()`, ...) use variant
    `name`'s library (`off` or None: the torch fallbacks); the previous one is back afterwards. For tests:
    it switches the whole process, so no other thread should run kernels meanwhile. Raises like
    `load_variant`."""
    lib = NO_LIBRARY if name in (None, "off") else load_variant(name)
    with STATE.lock:
        previous, STATE.active = STATE.active, lib
    try:
        yield lib
    finally:
        with STATE.lock:
            STATE.active = previous


def variant() -> str | None:
    """The variant whose kernels run (resolving it), or None when the torch fallbacks run."""
    return (STATE.active or resolve()).variant


def available() -> bool:
    """True when the C kernels are loaded (built on the first call; thread-safe; never raises)."""
    return bool((STATE.active or resolve()).kernels)


def qgemm_available() -> bool:
    """True when the quantized matmuls (`q4_matmul`, `q8_matmul`) and `decode_stack` run here: the active
    variant is avx512 or amx (AVX512-BW and AVX512-BF16)."""
    return bool((STATE.active or resolve()).qgemm)


def records_f32_available() -> bool:
    """True when the record matmuls and `decode_stack` take float32 activations here (int8 per group of
    32 inside the kernel): every variant has them, so whenever the C kernels are loaded."""
    return bool((STATE.active or resolve()).records_f32)


def qgemm_max_rows() -> int:
    """The most rows the record matmuls (and `decode_stack`) take here: 64 where the CPU and the OS allow
    AMX, 8 with AVX-512 alone, 0 without them."""
    return (STATE.active or resolve()).qgemm_max_rows


def qgemm_uses_amx(kind: int, rows: int) -> bool:
    """Whether a matmul of `rows` rows over int4 (kind 4) or int8 (kind 8) records runs through AMX, which
    rounds the dequantized weights to bfloat16 (see `q4_matmul_ref`)."""
    qgemm = (STATE.active or resolve()).qgemm
    return bool(qgemm) and bool(qgemm[3](int(kind == 8), rows))
