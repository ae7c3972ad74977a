"""GGUF block matmuls on AMX-INT8 tiles against the same library's AVX-512 VNNI kernel, rows 1..512.

    flock /tmp/izh-bench.lock nice -n -5 python -m benchmarks.gguf_amx

Builds the amx variant's library twice from csrc/ with the tiles' row threshold forced
(`-DGQ_AMX_MIN_M=1`: every matmul on the tiles; `-DGQ_AMX_MIN_M=1<<30`: none, the AVX-512 VNNI kernel the
avx512 variant runs), then times `izh_gguf_matmul_f32` (float32 x, the file's blocks, random) on Qwen2.5's
shapes (`SHAPES`: hidden 896 and 1536, N and K up to the 1.5B's 8960) for Q4_K, Q6_K, Q8_0 and Q5_0, the two libraries
alternating, the fastest of --repeats per point (the median recorded too). Its weights (a few MB) can stay in the
last-level cache between repeats, which favours the tiles; `gq_amx_min_rows` (csrc/gguf_blocks.c) is set from
whole decode steps of real models, whose weights stream from memory. Both libraries give the same bits (asserted on each
shape). Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.offline_throughput import write_record
from izh.kernels.cpu import compiler as B
from izh.kernels.cpu.gguf_blocks import GGUF_BLOCK_TYPES
from izh_cli.bench.report import cpu_model_and_flags
from tests.gguf_blocks_helpers import random_blocks

# (N, K) per block size: Qwen2.5-0.5B / 1.5B's linears (the K-quants only where K is a multiple of 256:
# llama.cpp stores the 0.5B's 896-input tensors as Q5_0 / Q8_0)
SHAPES = {
    32: [(896, 896), (4864, 896), (1536, 1536), (8960, 1536)],
    256: [(1536, 1536), (8960, 1536), (896, 4864), (1536, 8960)],
}


def _build(folder: Path, name: str, min_rows: int) -> ctypes.CDLL:
    out = folder / f"{name}.so"
    cmd = B.compile_command("amx", str(out), [str(p) for p in B.source_files()])
    cmd.insert(cmd.index("-o"), f"-DGQ_AMX_MIN_M={min_rows}")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    fn = lib.izh_gguf_matmul_f32
    fn.restype = ctypes.c_int
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ctypes.c_int, P, I64, P, I64, I64, I64, I64, P, I64, ctypes.c_int]
    lib.izh_gguf_uses_amx.restype = ctypes.c_int
    lib.izh_gguf_uses_amx.argtypes = [ctypes.c_int, I64]
    return lib


def _time(
    lib: ctypes.CDLL,
    type_id: int,
    x: torch.Tensor,
    raw: torch.Tensor,
    n: int,
    out: torch.Tensor,
    threads: int,
) -> float:
    m, k = x.shape
    start = time.perf_counter()
    rc = lib.izh_gguf_matmul_f32(
        type_id, x.data_ptr(), k, raw.data_ptr(), raw.stride(0), m, n, k, out.data_ptr(), n, threads
    )
    seconds = time.perf_counter() - start
    assert rc == 0, rc
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,12,16,24,32,64,128,256,512")
    ap.add_argument("--formats", default="Q4_K,Q6_K,Q8_0,Q5_0")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tiles, vnni = _build(Path(tmp), "tiles", 1), _build(Path(tmp), "vnni", 1 << 30)
        if not tiles.izh_gguf_uses_amx(12, 1):
            raise SystemExit("the AMX tiles do not run here (no AMX-INT8, or Linux refused the tile data)")
        results = []
        for name in args.formats.split(","):
            type_id, block, _ = GGUF_BLOCK_TYPES[name]
            for n, k in SHAPES[block]:
                raw = torch.from_numpy(random_blocks(name, n, k, np.random.default_rng(n + k)))
                x = torch.randn(max(rows), k)
                for m in rows:
                    xm = x[:m].contiguous()
                    a, b = torch.empty(m, n), torch.empty(m, n)
                    _time(tiles, type_id, xm, raw, n, a, args.threads)  # warm up both, and check the bits
                    _time(vnni, type_id, xm, raw, n, b, args.threads)
                    assert torch.equal(a, b), (name, n, k, m)
                    t_tiles, t_vnni = [], []
                    for _ in range(args.repeats):
                        t_tiles.append(_time(tiles, type_id, xm, raw, n, a, args.threads))
                        t_vnni.append(_time(vnni, type_id, xm, raw, n, b, args.threads))
                    # the fastest of the repeats: the host is shared, and slower runs are other work
                    tt, tv = min(t_tiles), min(t_vnni)
                    row = {
                        "format": name, "n": n, "k": k, "rows": m,
                        "amx_ms": round(tt * 1e3, 4), "vnni_ms": round(tv * 1e3, 4),
                        "amx_gmacs": round(m * n * k / tt / 1e9, 2), "vnni_gmacs": round(m * n * k / tv / 1e9, 2),
                        "speedup": round(tv / tt, 3),
                        "amx_median_ms": round(statistics.median(t_tiles) * 1e3, 4),
                        "vnni_median_ms": round(statistics.median(t_vnni) * 1e3, 4),
                    }  # fmt: skip
                    results.append(row)
                    print(
                        f"{name:5} N={n:5} K={k:5} M={m:4}  amx {tt * 1e3:9.3f} ms  vnni {tv * 1e3:9.3f} ms"
                        f"  x{tv / tt:5.2f}",
                        flush=True,
                    )
    flags = cpu_model_and_flags()[1]
    write_record(
        "gguf_amx",
        {
            "cpu_flags": [f for f in flags if f.startswith(("amx", "avx512_vnni", "avx512_bf16"))],
            "threads": args.threads,
            "repeats": args.repeats,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
