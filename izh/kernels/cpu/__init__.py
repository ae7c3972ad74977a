"""Fused CPU kernels for single-token decode steps, in C, with the torch references that define them.

A decode step of a small model on CPU is dominated by per-op dispatch (~5 us a torch op, ~35 ops a
layer). These kernels fuse the elementwise chains into one call each: `rms_norm`, `add_rms_norm_`,
`rotary_`, `silu_mul`, and `paged_decode_attention` (K/V write + attention over the paged cache for a batch
of single-token decodes). Each has a public `*_ref` in plain torch that defines its semantics; the C
kernel is used when the library is available, the tensors are on the CPU, the dtype is float32 or bfloat16
and the layout is one the kernel takes; otherwise the call falls through to the reference, so every
function works everywhere.

With AVX512-BW and AVX512-BF16 (`qgemm_available()`), the library also has weight-only matmuls for 1..8
rows (1..64 where AMX runs: `qgemm_max_rows()`) over weights packed as "records" (`pack_q4` / `pack_q8`:
int4 and int8 in groups of 32, defined by `unpack_q4` / `unpack_q8` and `q4_matmul_ref` /
`q8_matmul_ref`), `decode_stack`, which runs a whole decode step through every decoder layer with those
matmuls and the kernels above in one call (izh.model.fused_stack), and `argmax_rows` for greedy rows.

Rounding follows the references op for op: every elementwise op of a reference rounds its fp32 result to
bf16 (round to nearest even, as `c10::BFloat16`), and the C code rounds at the same points. `rotary_`,
`rms_norm` and `add_rms_norm_` are bit-identical to their references in both dtypes: RMSNorm's row sum
adds in the order of torch's CPU sum kernel (the `SumKernel.cpp` cascade: 8-lane vectors, 4 accumulators,
4 levels; stable across torch releases, checked by the tests; torch may split a single row longer than
32k elements across threads, which this does not copy). `silu_mul` uses a polynomial `exp` (torch uses
Sleef's), so an element may rarely differ by one ulp; `paged_decode_attention` works in fp32 with its own
summation order and rounds once at the end (bf16 scores come from vdpbf16ps where the CPU has it: exact
products, fp32 sums).

Build: `izh_cpu.c` (plain C11 + OpenMP, no torch headers) is compiled on first use with
`gcc -O3 -march=native -std=c11 -fPIC -shared -fopenmp -ffp-contract=off -fno-math-errno
-mprefer-vector-width=512` (about 3.5 s on a 2-core Xeon, most of it the attention kernel's copies for
head sizes 64 and 128 and the matmuls' copies for each row count) and loaded with ctypes. The library is
cached under `$IZH_CACHE_DIR/kernels/` (else `~/.cache/izh/kernels/`), named by a hash of the source, the
command, `gcc --version`, the machine and the CPU's flags (`-march=native` code must not be reused on
another CPU); it is built into a temporary file in that folder and moved into place with `os.replace`,
so concurrent builders are safe.
`IZH_CPU_KERNELS=0` turns the C kernels off (no compile). A missing compiler or a failed build logs one
warning and leaves the references in charge; `available()` never raises.

OpenMP runtime: torch's pip wheels bundle their own GNU OpenMP as `torch/lib/libgomp.so.1`, with the
same soname as the system's. Two runtimes in one process would each keep a pool of spinning threads that
fight over the cores, so the library is linked against torch's file itself, with an rpath to its folder.
Its DT_NEEDED is `libgomp.so.1`, which the dynamic loader resolves to the copy torch has already mapped
(checked: /proc/self/maps shows one libgomp after a parallel kernel and a torch matmul, and `ldd` on the
library alone resolves to torch's copy); linking against that file also proves at build time that every
GOMP symbol version the code needs exists there. The kernels' parallel regions thus reuse torch's OpenMP
thread pool. Without a bundled libgomp (a torch built against the system's), or if linking against it
fails, the plain `-fopenmp` link is used; the loader's soname match still shares whichever
`libgomp.so.1` torch loaded first. A torch built with Intel OpenMP (libiomp5) would get a second runtime:
the kernels still work but their threads compete with torch's.

Threads: the kernels take `torch.get_num_threads()` and stay on the calling thread when the work is
small (row kernels under 64k elements, attention under ~100 us of work; a single decode row always is):
waking a second thread costs more than it saves there, and on a busy machine it can stall. Attention runs
one (sequence, KV head) pair per work item, a sequence's KV heads handed out together (its blocks are
read by one thread). ctypes releases the GIL during a call.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BuildResult",
    "add_rms_norm_",
    "add_rms_norm_ref_",
    "argmax_rows",
    "argmax_rows_ref",
    "available",
    "build",
    "decode_stack",
    "default_cache_dir",
    "inverse_cdf_ref",
    "pack_q4",
    "pack_q8",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "q4_matmul",
    "q4_matmul_ref",
    "q8_matmul",
    "q8_matmul_ref",
    "qgemm_available",
    "qgemm_max_rows",
    "qgemm_uses_amx",
    "rms_norm",
    "rms_norm_ref",
    "rotary_",
    "rotary_ref_",
    "sample_rows",
    "sample_rows_ref",
    "silu_mul",
    "silu_mul_ref",
    "top_p_mask_",
    "unpack_q4",
    "unpack_q8",
]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("izh_cpu.c")
_ABI_VERSION = 5  # izh_cpu_abi_version() in the C file
_CC = "gcc"
_CFLAGS = (
    "-O3",
    "-march=native",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-ffp-contract=off",  # rotary must round each product on its own, as torch does
    "-fno-math-errno",
    "-mprefer-vector-width=512",
)
_ENV_SWITCH = "IZH_CPU_KERNELS"
_MAX_HEAD_DIM = 512  # 32 * MAX_NC in the C file

# --- torch references -------------------------------------------------------------------------------


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim. float32: `F.rms_norm` with the weight. Other dtypes: normalise in fp32,
    round to the dtype, then multiply by the weight in the dtype (one more rounding)."""
    hidden = x.shape[-1]
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (hidden,), weight, eps)
    return F.rms_norm(x.float(), (hidden,), None, eps).to(x.dtype) * weight


def add_rms_norm_ref_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`residual += x` in place (rounded to the dtype), then `rms_norm_ref(residual)` as a new tensor."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


def rotary_ref_(x: Tensor, cos_sin: Tensor) -> None:
    """Rotate-half RoPE in place. x: [n, heads, head_dim] (any strides); cos_sin: [n, head_dim], cos in the
    first half, sin in the second."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x1 = x[..., :half]
    x2 = x[..., half:]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """`silu(gate) * up` for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def paged_decode_attention_ref(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """Single-token decode attention over a paged KV cache, one sequence at a time in fp32.

    query [n, H, d], key/value [n, KVH, d]: sequence i's new token. kv_cache [2, blocks, block_size, KVH, d].
    Writes key[i]/value[i] to slot `slot_mapping[i]` (slots < 0 are skipped), then sequence i attends to
    positions 0..seq_lens[i]-1 (the new one included), position p at block `block_tables[i, p //
    block_size]`, offset `p % block_size`; query head h reads KV head `h // (H // KVH)`. Returns a new
    contiguous [n, H, d] in query's dtype.
    """
    # The general paged-attention semantics (izh.kernels.paged_attention), with one query per sequence.
    from izh.kernels.paged_attention import paged_attention_reference, write_kv_cache_reference

    write_kv_cache_reference(key, value, kv_cache, slot_mapping)
    query_start_loc = torch.arange(query.shape[0] + 1, device=query.device)
    return paged_attention_reference(
        query.contiguous(), kv_cache, query_start_loc, seq_lens, block_tables, scale
    )


# --- build and load ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildResult:
    """What `build` did: `path` is the library (None when there is none), `compiled` False when it came
    from the cache, `seconds` the compile time, `error` why there is no library."""

    path: Path | None
    compiled: bool = False
    seconds: float = 0.0
    error: str | None = None


def default_cache_dir() -> Path:
    """`$IZH_CACHE_DIR/kernels`, else `~/.cache/izh/kernels`."""
    base = os.environ.get("IZH_CACHE_DIR") or "~/.cache/izh"
    return Path(base).expanduser() / "kernels"


def _torch_libgomp() -> str | None:
    """torch's bundled GNU OpenMP runtime (pip wheels ship `torch/lib/libgomp*.so*`), if any."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return found[0] if found else None


def _command(compiler: str, source: str, output: str, torch_gomp: bool = True) -> list[str]:
    cmd = [compiler, *_CFLAGS, "-o", output, source]
    gomp = _torch_libgomp() if torch_gomp else None
    if gomp is not None:
        # Resolve the GOMP symbols against torch's runtime (the one already mapped in this process).
        cmd += [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"]
    return [*cmd, "-lm"]


def _compiler_version(compiler: str) -> str:
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = run.stdout.splitlines()
    return lines[0] if lines else ""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build(cache_dir: Path | str | None = None, compiler: str = _CC) -> BuildResult:
    """Compile `izh_cpu.c` into `<cache_dir>/izh_cpu-<hash>.so`, or reuse the cached one. Never raises.

    cache_dir defaults to `default_cache_dir()`. The hash covers the source, the command, the compiler's
    version line, the machine and the CPU flags.
    """
    exe = shutil.which(compiler)
    if exe is None:
        return BuildResult(None, error=f"no C compiler ({compiler!r} not on PATH)")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        source_text = SOURCE.read_bytes()
    except OSError as exc:
        return BuildResult(None, error=f"cannot read {SOURCE}: {exc}")
    key = hashlib.sha256()
    for part in (
        source_text,
        "\0".join(_command(compiler, "<src>", "<out>")).encode(),
        _compiler_version(exe).encode(),
        platform.machine().encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
        key.update(b"\x1e")
    target = folder / f"izh_cpu-{key.hexdigest()[:20]}.so"
    if target.is_file():
        return BuildResult(target)

    tmp: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".izh_cpu-", suffix=".so.tmp")
        os.close(fd)
        start = time.perf_counter()
        run = subprocess.run(
            _command(exe, str(SOURCE), tmp), capture_output=True, text=True, timeout=300, cwd=folder
        )
        if run.returncode != 0 and _torch_libgomp() is not None:
            # Linking against torch's libgomp failed: try the system runtime (the loader still shares
            # torch's copy by soname when torch's is mapped first).
            plain = subprocess.run(
                _command(exe, str(SOURCE), tmp, torch_gomp=False),
                capture_output=True,
                text=True,
                timeout=300,
                cwd=folder,
            )
            if plain.returncode == 0:
                logger.debug("linking against torch's libgomp failed, used the system one:\n%s", run.stderr)
                run = plain
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            tail = (run.stderr or run.stdout)[-2000:]
            return BuildResult(None, compiled=True, seconds=seconds, error=f"compile failed:\n{tail}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        tmp = None
        logger.debug("built %s in %.2f s", target, seconds)
        return BuildResult(target, compiled=True, seconds=seconds)
    except (OSError, subprocess.SubprocessError) as exc:
        return BuildResult(None, error=f"build failed: {exc}")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # x, x_stride, w, out, n, hidden, eps, nt
    "rms_norm": (None, [_P, _I64, _P, _P, _I64, _I64, _F32, _INT]),
    # x, residual, w, out, n, hidden, eps, nt
    "add_rms_norm": (None, [_P, _P, _P, _P, _I64, _I64, _F32, _INT]),
    # x, token_stride, head_stride, cos_sin, n, heads, head_dim, nt
    "rotary": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _INT]),
    # gate_up, row_stride, out, n, intermediate, nt
    "silu_mul": (None, [_P, _I64, _P, _I64, _I64, _INT]),
    # q, q_ts, q_hs, k, k_ts, k_hs, v, v_ts, v_hs, kv_cache, num_blocks, block_size, kvh,
    # slot_mapping, block_tables, max_blocks, seq_lens, out, n, H, d, scale, nt
    "paged_decode_attention": (
        _INT,
        [*(_P, _I64, _I64) * 3, _P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _INT],
    ),
}


class _Kernels(NamedTuple):
    rms_norm: Any
    add_rms_norm: Any
    rotary: Any
    silu_mul: Any
    paged_decode_attention: Any


def _bind(lib: ctypes.CDLL, suffix: str) -> _Kernels:
    funcs = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, f"izh_{name}_{suffix}")
        fn.restype = restype
        fn.argtypes = argtypes
        funcs[name] = fn
    return _Kernels(**funcs)


def _enabled() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _load_library(cache_dir: Path | str | None = None) -> dict[torch.dtype, _Kernels] | None:
    """Build (or reuse) and load the library; None (after one warning) when it cannot be had."""
    if not _enabled():
        logger.debug("%s=0: CPU C kernels disabled", _ENV_SWITCH)
        return None
    result = build(cache_dir)
    if result.path is None:
        logger.warning("izh CPU kernels unavailable, using the torch fallbacks: %s", result.error)
        return None
    if result.compiled:
        logger.info("compiled izh CPU kernels in %.2f s: %s", result.seconds, result.path)
    try:
        lib = ctypes.CDLL(str(result.path))
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
        _sampling.extend((lib.izh_argmax_rows_f32, lib.izh_sample_rows_f32, lib.izh_top_p_rows_f32))
        lib.izh_qgemm_available.restype = ctypes.c_int
        if lib.izh_qgemm_available():
            for name in ("izh_q4_gemm", "izh_q8_gemm"):
                fn = getattr(lib, name)
                fn.restype = _INT
                fn.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _P, _I64, _INT, _INT]
            stack = lib.izh_decode_stack_bf16
            stack.restype = _INT
            stack.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _P, _P, _P, _P]
            stack.argtypes += [_P, _P, _I64, _P, _I64, _I64, _INT]
            lib.izh_qgemm_max_rows.restype = _INT
            lib.izh_qgemm_uses_amx.restype = _INT
            lib.izh_qgemm_uses_amx.argtypes = [_INT, _I64]
            _qgemm.extend((lib.izh_q4_gemm, lib.izh_q8_gemm, stack, lib.izh_qgemm_uses_amx))
            _qgemm_rows.append(int(lib.izh_qgemm_max_rows()))
        return kernels
    except (OSError, AttributeError) as exc:
        logger.warning(
            "izh CPU kernels unavailable, using the torch fallbacks: cannot load %s: %s", result.path, exc
        )
        return None


_lock = threading.Lock()
_resolved = False
_kernels: dict[torch.dtype, _Kernels] = {}  # filled once, when the library loads
_qgemm: list[Any] = []  # [q4, q8, decode stack, uses_amx] C functions when the CPU has AVX512-BF16
_qgemm_rows: list[int] = []  # [izh_qgemm_max_rows()]: 64 with AMX, else 8
_sampling: list[Any] = []  # [izh_argmax_rows_f32, izh_sample_rows_f32, izh_top_p_rows_f32]


def _resolve() -> dict[torch.dtype, _Kernels]:
    global _resolved
    with _lock:
        if not _resolved:
            try:
                loaded = _load_library()
            except Exception as exc:  # never let a build problem escape into a forward pass
                logger.warning("izh CPU kernels unavailable, using the torch fallbacks: %s", exc)
                loaded = None
            if loaded:
                _kernels.update(loaded)
            _resolved = True
    return _kernels


def available() -> bool:
    """True when the C kernels are loaded (built on the first call; thread-safe; never raises)."""
    return bool(_kernels if _resolved else _resolve())


def qgemm_available() -> bool:
    """True when the quantized matmuls (`q4_matmul`, `q8_matmul`) run here: the library is loaded and the
    CPU has AVX512-BW and AVX512-BF16."""
    if not _resolved:
        _resolve()
    return bool(_qgemm)


def qgemm_max_rows() -> int:
    """The most rows the record matmuls (and `decode_stack`) take here: 64 where the CPU and the OS allow
    AMX, 8 with AVX-512 alone, 0 without the kernels."""
    return _qgemm_rows[0] if qgemm_available() else 0


def qgemm_uses_amx(kind: int, rows: int) -> bool:
    """Whether a matmul of `rows` rows over int4 (kind 4) or int8 (kind 8) records runs through AMX, which
    rounds the dequantized weights to bfloat16 (see `q4_matmul_ref`)."""
    return qgemm_available() and bool(_qgemm[3](int(kind == 8), rows))


# --- entry points -----------------------------------------------------------------------------------
#
# Each wrapper costs a few microseconds of Python (ctypes ~1 us, allocating the output ~1 us), so the checks
# are kept to cheap attribute reads; anything unusual (another device or dtype, mixed dtypes, an inner
# stride != 1) takes the reference.


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm_ref(x, weight, eps)` as a new [n, hidden] tensor; x may have a row stride."""
    k = (_kernels if _resolved else _resolve()).get(x.dtype)
    if (
        k is not None
        and x.is_cpu
        and weight.is_cpu
        and weight.dtype == x.dtype
        and x.dim() == 2
        and weight.dim() == 1
        and weight.is_contiguous()
    ):
        n, hidden = x.shape
        x_stride = x.stride()
        if x_stride[1] == 1 and weight.shape[0] == hidden:
            out = x.new_empty(n, hidden)  # (int args: ~0.6 us cheaper than torch.empty((n, hidden), ...))
            k.rms_norm(
                x.data_ptr(),
                x_stride[0],
                weight.data_ptr(),
                out.data_ptr(),
                n,
                hidden,
                eps,
                torch.get_num_threads(),
            )
            return out
    return rms_norm_ref(x, weight, eps)


def add_rms_norm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`residual += x` in place, then `rms_norm(residual, weight, eps)` as a new tensor."""
    k = (_kernels if _resolved else _resolve()).get(x.dtype)
    if (
        k is not None
        and x.is_cpu
        and residual.is_cpu
        and weight.is_cpu
        and residual.dtype == x.dtype
        and weight.dtype == x.dtype
        and x.dim() == 2
        and weight.dim() == 1
        and x.is_contiguous()
        and residual.is_contiguous()
        and weight.is_contiguous()
    ):
        n, hidden = x.shape
        if residual.shape == x.shape and weight.shape[0] == hidden:
            out = x.new_empty(n, hidden)
            k.add_rms_norm(
                x.data_ptr(),
                residual.data_ptr(),
                weight.data_ptr(),
                out.data_ptr(),
                n,
                hidden,
                eps,
                torch.get_num_threads(),
            )
            return out
    return add_rms_norm_ref_(x, residual, weight, eps)


def rotary_(x: Tensor, cos_sin: Tensor) -> None:
    """`rotary_ref_(x, cos_sin)`: in-place rotate-half RoPE on x [n, heads, head_dim], any token and head
    stride (element stride 1); cos_sin [n, head_dim] = [cos | sin]."""
    k = (_kernels if _resolved else _resolve()).get(x.dtype)
    if (
        k is not None
        and x.is_cpu
        and cos_sin.is_cpu
        and cos_sin.dtype == x.dtype
        and x.dim() == 3
        and cos_sin.is_contiguous()
    ):
        n, heads, head_dim = x.shape
        x_stride = x.stride()
        if x_stride[2] == 1 and head_dim % 2 == 0 and cos_sin.shape == (n, head_dim):
            k.rotary(
                x.data_ptr(),
                x_stride[0],
                x_stride[1],
                cos_sin.data_ptr(),
                n,
                heads,
                head_dim,
                torch.get_num_threads(),
            )
            return
    rotary_ref_(x, cos_sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """`silu_mul_ref(gate_up)`: [n, 2 * I] -> new [n, I]."""
    k = (_kernels if _resolved else _resolve()).get(gate_up.dtype)
    if k is not None and gate_up.is_cpu and gate_up.dim() == 2:
        n, width = gate_up.shape
        stride = gate_up.stride()
        if stride[1] == 1 and width % 2 == 0:
            out = gate_up.new_empty(n, width // 2)
            k.silu_mul(gate_up.data_ptr(), stride[0], out.data_ptr(), n, width // 2, torch.get_num_threads())
            return out
    return silu_mul_ref(gate_up)


_ATTENTION_ERRORS = {
    -1: "slot_mapping points past the end of the cache",
    -2: "a seq_len is negative or longer than its block table covers",
    -3: "a block table entry is outside the cache",
    -4: "out of memory for the attention scratch",
}


def paged_decode_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
) -> Tensor:
    """`paged_decode_attention_ref(...)`: write each sequence's new K/V into the cache, then attend.

    query [n, H, d], key/value [n, KVH, d] (views with any token and head stride, element stride 1);
    kv_cache contiguous [2, num_blocks, block_size, KVH, d]; slot_mapping int64 [n] (slots < 0 skipped);
    block_tables int32 [n, max_blocks]; seq_lens int32 [n] (other integer dtypes are converted). Returns a
    new contiguous [n, H, d]. Raises IndexError, before writing anything, when an index points outside
    the cache or the block table.
    """
    dtype = query.dtype
    k = (_kernels if _resolved else _resolve()).get(dtype)
    if not (
        k is not None
        and key.dtype == dtype
        and value.dtype == dtype
        and kv_cache.dtype == dtype
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and kv_cache.is_cpu
        and slot_mapping.is_cpu
        and block_tables.is_cpu
        and seq_lens.is_cpu
        and query.dim() == 3
        and key.dim() == 3
        and value.dim() == 3
        and kv_cache.dim() == 5
        and block_tables.dim() == 2
        and kv_cache.is_contiguous()
    ):
        return paged_decode_attention_ref(
            query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, scale
        )
    n, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, cache_dim = kv_cache.shape
    q_stride, k_stride, v_stride = query.stride(), key.stride(), value.stride()
    if q_stride[2] != 1 or k_stride[2] != 1 or v_stride[2] != 1 or head_dim > _MAX_HEAD_DIM:
        return paged_decode_attention_ref(
            query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, scale
        )
    kv_shape = (n, num_kv_heads, head_dim)
    if (
        cache_dim != head_dim
        or num_heads % num_kv_heads
        or key.shape != kv_shape
        or value.shape != kv_shape
        or slot_mapping.shape != (n,)
        or seq_lens.shape != (n,)
        or block_tables.shape[0] != n
    ):
        shapes = {
            "query": query,
            "key": key,
            "value": value,
            "kv_cache": kv_cache,
            "slot_mapping": slot_mapping,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
        }
        listed = ", ".join(f"{name} {tuple(t.shape)}" for name, t in shapes.items())
        raise ValueError(f"paged_decode_attention: shapes do not match: {listed}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        block_tables = block_tables.to(torch.int32).contiguous()
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    out = query.new_empty(n, num_heads, head_dim)
    rc = k.paged_decode_attention(
        query.data_ptr(),
        q_stride[0],
        q_stride[1],
        key.data_ptr(),
        k_stride[0],
        k_stride[1],
        value.data_ptr(),
        v_stride[0],
        v_stride[1],
        kv_cache.data_ptr(),
        num_blocks,
        block_size,
        num_kv_heads,
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        n,
        num_heads,
        head_dim,
        scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise IndexError(f"paged_decode_attention: {_ATTENTION_ERRORS.get(rc, f'error {rc}')}")
    return out


# --- weight-only quantized matmuls (1..qgemm_max_rows() rows) ------------------------------------------
#
# Records as izh_cpu.c lays them out (see the comment there): weights in the order the kernel streams
# them, 16 output rows at a time, one fixed-size record per group of 32 inputs. `pack_*` builds them from
# codes and scales, `unpack_*` turns them back into a float weight (the reference), `q*_matmul` runs them.

Q4_RECORD_BYTES = 320
Q8_RECORD_BYTES = 544
QGEMM_GROUP = 32


def _check_qshape(n: int, k: int) -> None:
    if n <= 0 or k <= 0 or n % 16 or k % QGEMM_GROUP:
        raise ValueError(f"quantized records need out % 16 == 0 and in % {QGEMM_GROUP} == 0, got ({n}, {k})")


def _rows_bf16(v: Tensor, tiles: int, groups: int) -> Tensor:
    """[N, groups] values -> [tiles, groups, 16 rows] bf16, as bytes [tiles, groups, 32]."""
    return v.to(torch.bfloat16).reshape(tiles, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _rows_from_bf16(b: Tensor, n: int, groups: int) -> Tensor:
    """Inverse of `_rows_bf16`: bytes [tiles, groups, 32] -> float32 [N, groups]."""
    return b.contiguous().view(torch.bfloat16).float().transpose(1, 2).reshape(n, groups)


def pack_q4(codes: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """int4 records (uint8 [N / 16, K / 32, 320]) for w = code * scale + min: codes [N, K] in 0..15,
    scales and mins [N, K / 32] (stored as bfloat16)."""
    n, k = codes.shape
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    # Input 32 g + 4 b + 2 h + e of row i goes to byte 2 i + e of block b, low nibble for h = 0.
    c = codes.to(torch.uint8).reshape(tiles, 16, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
    nibbles = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 256)
    return torch.cat(
        (nibbles, _rows_bf16(scales, tiles, groups), _rows_bf16(mins, tiles, groups)), dim=2
    ).contiguous()


def unpack_q4(records: Tensor, n: int, k: int) -> Tensor:
    """The float32 weight [N, K] that int4 records hold."""
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    r = records.reshape(tiles, groups, Q4_RECORD_BYTES)
    nibbles = r[..., :256].reshape(tiles, groups, 8, 16, 2)  # [t, g, b, i, e]
    codes = torch.stack((nibbles & 15, nibbles >> 4), dim=-1)  # [t, g, b, i, e, h]
    codes = codes.permute(0, 3, 1, 2, 5, 4).reshape(n, k).float()  # [t, i, g, b, h, e]
    scales = _rows_from_bf16(r[..., 256:288], n, groups).repeat_interleave(QGEMM_GROUP, 1)
    mins = _rows_from_bf16(r[..., 288:320], n, groups).repeat_interleave(QGEMM_GROUP, 1)
    return codes * scales + mins


def pack_q8(codes: Tensor, scales: Tensor) -> Tensor:
    """int8 records (uint8 [N / 16, K / 32, 544]) for w = code * scale: codes [N, K] in -128..127, scales
    [N, K / 32] (stored as bfloat16)."""
    n, k = codes.shape
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    c = codes.to(torch.int8).reshape(tiles, 16, groups, QGEMM_GROUP).permute(0, 2, 3, 1)  # [t, g, k, i]
    c = c.contiguous().view(torch.uint8).reshape(tiles, groups, 512)
    return torch.cat((c, _rows_bf16(scales, tiles, groups)), dim=2).contiguous()


def unpack_q8(records: Tensor, n: int, k: int) -> Tensor:
    """The float32 weight [N, K] that int8 records hold."""
    _check_qshape(n, k)
    tiles, groups = n // 16, k // QGEMM_GROUP
    r = records.reshape(tiles, groups, Q8_RECORD_BYTES)
    codes = r[..., :512].contiguous().view(torch.int8).reshape(tiles, groups, QGEMM_GROUP, 16)
    codes = codes.permute(0, 3, 1, 2).reshape(n, k).float()
    return codes * _rows_from_bf16(r[..., 512:], n, groups).repeat_interleave(QGEMM_GROUP, 1)


def q4_matmul_ref(
    x: Tensor,
    records: Tensor,
    n: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    *,
    bf16_weights: bool = False,
) -> Tensor:
    """x [M, K] @ W^T in float32, rounded once to `out_dtype` (default x's dtype). `bf16_weights` rounds W
    to bfloat16 first, as the AMX kernel does (`qgemm_uses_amx`)."""
    return _matmul_ref(x, unpack_q4(records, n, k), out_dtype, bf16_weights)


def q8_matmul_ref(
    x: Tensor,
    records: Tensor,
    n: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    *,
    bf16_weights: bool = False,
) -> Tensor:
    """As `q4_matmul_ref`, for int8 records."""
    return _matmul_ref(x, unpack_q8(records, n, k), out_dtype, bf16_weights)


def _matmul_ref(x: Tensor, w: Tensor, out_dtype: torch.dtype | None, bf16_weights: bool) -> Tensor:
    if bf16_weights:
        w = w.bfloat16().float()
    return (x.float() @ w.T).to(out_dtype or x.dtype)


def _qgemm_call(which: int, x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None) -> Tensor | None:
    """Run the C kernel when it applies (None otherwise): x bf16 [1..qgemm_max_rows(), K] with unit inner
    stride; out
    None (a new bf16 [M, N]) or a float32 / bfloat16 [>= M, N] tensor with unit inner stride.

    Kept lean (~5 us with the ctypes call): it runs once per linear in small decode steps that do not
    take the fused stack."""
    fns = _qgemm or (_resolve(), _qgemm)[1]
    if not fns or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_cpu:
        return None
    m, x_cols = x.shape
    x_strides = x.stride()
    if m < 1 or m > _qgemm_rows[0] or x_cols != k or x_strides[1] != 1:
        return None
    result = out
    if out is None:
        out = result = x.new_empty(m, n)
    elif not (
        out.is_cpu
        and out.dtype in (torch.float32, torch.bfloat16)
        and out.dim() == 2
        and out.shape[0] >= m
        and out.shape[1] == n
        and out.stride(1) == 1
    ):
        return None
    elif out.shape[0] != m:
        result = out[:m]
    rc = fns[which](
        x.data_ptr(),
        x_strides[0],
        records.data_ptr(),
        m,
        n,
        k,
        out.data_ptr(),
        out.stride(0),
        out.dtype == torch.float32,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"quantized matmul failed (code {rc}) for x {tuple(x.shape)}, weight ({n}, {k})")
    return result


def q4_matmul(x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None = None) -> Tensor:
    """`q4_matmul_ref(x, ..., bf16_weights=qgemm_uses_amx(4, M))` for x [M <= qgemm_max_rows(), K]: a new
    bf16 [M, N], or written into out[:M] (float32 or bfloat16, e.g. a logits buffer) and returned.
    records: `pack_q4`'s, contiguous. Other inputs get the reference."""
    return _qgemm_or_ref(0, q4_matmul_ref, x, records, n, k, out)


def q8_matmul(x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None = None) -> Tensor:
    """As `q4_matmul`, for `pack_q8` records (AMX from `qgemm_uses_amx(8, M)`)."""
    return _qgemm_or_ref(1, q8_matmul_ref, x, records, n, k, out)


def _qgemm_or_ref(
    which: int, ref: Callable[..., Tensor], x: Tensor, records: Tensor, n: int, k: int, out: Tensor | None
) -> Tensor:
    got = _qgemm_call(which, x, records, n, k, out)
    if got is not None:
        return got
    y = ref(x, records, n, k, out.dtype if out is not None else None)
    return y if out is None else out[: y.shape[0]].copy_(y)


# --- the fused decode stack -----------------------------------------------------------------------------

STACK_FIELDS = 15
"""int64 fields per layer in `decode_stack`'s table (see izh_decode_stack_bf16 in izh_cpu.c)."""


def decode_stack(
    table: Tensor,
    dims: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    x: Tensor,
    final_norm: Tensor,
    cos_sin: Tensor,
    kv_geometry: tuple[int, int],
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
) -> Tensor:
    """Every decoder layer plus the final norm for M <= qgemm_max_rows() single-token decodes, in one C call.

    table: int64 [layers, STACK_FIELDS] (`izh.model.fused_stack` builds it); dims: (hidden, heads, kv heads,
    head_dim, intermediate); x: bf16 [M, hidden] embeddings, overwritten (it carries the residual stream);
    cos_sin [M, head_dim]; kv_geometry: (num_blocks, block_size); slot_mapping int64 [M], block_tables
    int32 [M, max_blocks], seq_lens int32 [M]. Returns the final-normed hidden states [M, hidden]. Only
    callable when `qgemm_available()`; raises IndexError for an index outside the cache (nothing written).
    """
    hidden, heads, kv_heads, head_dim, inter = dims
    m = x.shape[0]
    out = x.new_empty(m, hidden)
    rc = _qgemm[2](
        table.data_ptr(),
        table.shape[0],
        m,
        hidden,
        heads,
        kv_heads,
        head_dim,
        inter,
        eps,
        scale,
        x.data_ptr(),
        final_norm.data_ptr(),
        out.data_ptr(),
        cos_sin.data_ptr(),
        slot_mapping.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        kv_geometry[0],
        kv_geometry[1],
        torch.get_num_threads(),
    )
    if rc != 0:
        if rc in _ATTENTION_ERRORS and rc != -4:
            raise IndexError(f"decode_stack: {_ATTENTION_ERRORS[rc]}")
        reasons = {-4: "out of memory", -5: "too many rows", -6: "a matmul refused its shape"}
        raise RuntimeError(f"decode_stack failed: {reasons.get(rc, f'code {rc}')}")
    return out


# --- greedy and random rows -------------------------------------------------------------------------------


def argmax_rows_ref(x: Tensor) -> Tensor:
    """Per row of x [rows, n], the index of the first maximum (a NaN counts as the maximum), int64 [rows]."""
    return x.max(dim=-1).indices


def _sampling_kernels(logits: Tensor, per_row: Tensor | None = None) -> list[Any] | None:
    """The C sampling kernels when they take these rows: logits float32 [rows, n > 0] on the CPU with
    unit inner stride, and `per_row` (a uniform or top_p vector, any dtype the caller checked) a
    contiguous CPU [rows]; else None (the caller uses torch)."""
    fns = _sampling or (_resolve(), _sampling)[1]
    if not (
        fns
        and logits.dtype == torch.float32
        and logits.is_cpu
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.shape[1] > 0
    ):
        return None
    if per_row is not None and not (
        per_row.is_cpu and per_row.is_contiguous() and per_row.shape == (logits.shape[0],)
    ):
        return None
    return fns


def argmax_rows(x: Tensor) -> Tensor:
    """`argmax_rows_ref(x)`: one C pass over float32 CPU rows (rows in parallel), else torch."""
    fns = _sampling_kernels(x)
    if fns is None:
        return argmax_rows_ref(x)
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    fns[0](x.data_ptr(), x.stride(0), rows, n, out.data_ptr(), torch.get_num_threads())
    return out


def inverse_cdf_ref(probs: Tensor, uniform: Tensor) -> Tensor:
    """Per row of probs [rows, n] (need not sum to 1) and uniform [rows] float64 in [0, 1): the first
    token whose cumulative probability (float64) exceeds u times the row's total (int64 [rows])."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    targets = (uniform * cdf[:, -1]).unsqueeze(1)
    sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return sampled.clamp_(max=probs.shape[1] - 1)


def sample_rows_ref(logits: Tensor, uniform: Tensor) -> Tensor:
    """A token per row of logits [rows, n] drawn from softmax(logits) by inverse CDF with `uniform`."""
    return inverse_cdf_ref(logits.softmax(dim=-1), uniform)


def sample_rows(logits: Tensor, uniform: Tensor) -> Tensor:
    """`sample_rows_ref(logits, uniform)` in one C pass per row for float32 CPU rows (rows in parallel):
    softmax's exps are summed in float64 by chunks, and no probability tensor is built (at 32 x 49k:
    0.7 ms against 1.9 ms). The same distribution; a draw within rounding of a token boundary may pick
    the neighbouring token."""
    fns = _sampling_kernels(logits, uniform) if uniform.dtype == torch.float64 else None
    if fns is not None:
        rows, n = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        rc = fns[1](
            logits.data_ptr(),
            logits.stride(0),
            rows,
            n,
            uniform.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 0:
            return out
    return sample_rows_ref(logits, uniform)


def top_p_mask_(logits: Tensor, top_p: Tensor) -> Tensor | None:
    """Top-p in place on float32 CPU rows (rows with top_p >= 1 untouched): every token outside the
    nucleus becomes -inf. The nucleus is `izh.engine.sampler._apply_top_p_sorted`'s (descending
    probability, ties by token id, kept while the mass before a token is < top_p), with float64
    probabilities. Returns logits, or None when the C kernel does not apply (the caller uses torch)."""
    fns = _sampling_kernels(logits, top_p) if top_p.dtype == torch.float32 else None
    if fns is None:
        return None
    rows, n = logits.shape
    rc = fns[2](logits.data_ptr(), logits.stride(0), rows, n, top_p.data_ptr(), torch.get_num_threads())
    return logits if rc == 0 else None
