"""Two builds of izh's float32 record matmuls in one process, called alternately: a kernel change
measured against its base on a noisy shared machine.

    git worktree add /tmp/base <sha>
    python benchmarks/records_ab.py --base /tmp/base --variant avx2 --rows 1,8,32,128

Each checkout's kernel library is built (or taken from its cache) for the variant; both are loaded
with ctypes, and one decode step's matmuls on SmolLM2's shapes (30 layers of int4 records, distinct
weights so they stream from memory as in the engine, then the 49152 x 576 int8 LM head) run through
one library and then the other, `--repeats` times per row count. Prints the medians and their ratio;
nothing is written.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.qgemm import HEAD_SHAPE, LAYER_SHAPES  # noqa: E402
from izh.model.packed import quantize_q4_records, quantize_q8_records  # noqa: E402

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p]


def library(checkout: Path, variant: str, cache: Path) -> ctypes.CDLL:
    """The checkout's kernel library for `variant`, built by the checkout's own compiler module."""
    code = (
        "from izh.kernels.cpu.compiler import build; "
        f"r = build({str(cache)!r}, variant={variant!r}); print(r.path or '', r.error or '')"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=False
    )
    path, _, error = run.stdout.strip().partition(" ")
    if run.returncode or not path:
        raise SystemExit(f"no {variant} library from {checkout}: {error or run.stderr[-2000:]}")
    return ctypes.CDLL(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout (a git worktree)")
    ap.add_argument("--variant", default="avx2")
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    libs = {
        "base": library(Path(args.base).resolve(), args.variant, Path("/tmp/izh-records-ab/base")),
        "this": library(ROOT, args.variant, Path("/tmp/izh-records-ab/this")),
    }
    for lib in libs.values():
        for name in ("izh_q4_gemm_f32", "izh_q8_gemm_f32"):
            getattr(lib, name).argtypes = [*_ARGS, ctypes.c_int64, ctypes.c_int]
    torch.manual_seed(0)
    layers = [
        [quantize_q4_records(torch.randn(o, i) * 0.02).records for o, i in LAYER_SHAPES]
        for _ in range(args.layers)
    ]
    head = quantize_q8_records(torch.randn(*HEAD_SHAPE) * 0.02).records

    def step(lib: ctypes.CDLL, m: int, xs: dict[int, torch.Tensor], out: torch.Tensor) -> tuple[float, float]:
        t0 = time.perf_counter()
        for layer in layers:
            for (n, k), w in zip(LAYER_SHAPES, layer, strict=True):
                x = xs[k]
                lib.izh_q4_gemm_f32(x.data_ptr(), k, w.data_ptr(), m, n, k, out.data_ptr(), n, args.threads)
        t1 = time.perf_counter()
        n, k = HEAD_SHAPE
        lib.izh_q8_gemm_f32(xs[k].data_ptr(), k, head.data_ptr(), m, n, k, out.data_ptr(), n, args.threads)
        return t1 - t0, time.perf_counter() - t1

    print(
        f"{'rows':>5} {'layers base':>12} {'this':>9} {'ratio':>6} {'head base':>10} {'this':>8} {'ratio':>6}"
    )
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, k in LAYER_SHAPES}}
        out = torch.empty(m, HEAD_SHAPE[0])
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
        for _ in range(args.repeats):
            for name, lib in libs.items():
                times[name].append(step(lib, m, xs, out))
        (lb, hb), (lt, ht) = (
            (statistics.median(t[0] for t in times[name]), statistics.median(t[1] for t in times[name]))
            for name in ("base", "this")
        )
        print(
            f"{m:5d} {lb * 1e3:9.2f} ms {lt * 1e3:6.2f} ms {lb / lt:5.2f}x "
            f"{hb * 1e3:7.2f} ms {ht * 1e3:5.2f} ms {hb / ht:5.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
