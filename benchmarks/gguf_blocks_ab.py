"""Two builds of izh's GGUF block matmuls in one process, called alternately, on a real model file's tensors: a
kernel change measured against its base on a noisy shared machine.

    git worktree add /tmp/base <sha>
    python benchmarks/gguf_blocks_ab.py --base /tmp/base --gguf qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --variant avx2 --rows 1,8,32,64

Each checkout's kernel library is built (or taken from its cache) for the variant by its own compiler module and
loaded with ctypes; `izh_gguf_matmul_f32` of each named tensor (the file's bytes; float32 activations, random)
runs through one library and then the other, `--repeats` times per row count (fewer for a tensor of over 100,000
rows, the LM head). Prints the medians, GMAC/s and their ratio, and whether both gave the same bits; nothing is
written.

`--sweep` instead runs every linear weight of the file (all but the token embedding) in the file's order, as a
decode step does, one library's whole pass and then the other's (each first in half of them): the weights stream
from memory as in a step (one tensor repeated sits in the cache), and the medians of the passes are printed per
block type and in all.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.records_ab import library  # noqa: E402

TENSORS = (
    "blk.0.ffn_gate.weight,blk.0.attn_q.weight,blk.0.ffn_down.weight,blk.2.ffn_down.weight,output.weight"
)
"""Qwen2.5-Coder-0.5B Q4_K_M's kinds: Q5_0 (gate, up, q, o), Q6_K and Q4_K (down, alternating), Q8_0 (LM head)."""
_I64, _P = ctypes.c_int64, ctypes.c_void_p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the other checkout (a git worktree)")
    ap.add_argument("--gguf", required=True, help="a GGUF file whose tensors to multiply by")
    ap.add_argument("--tensors", default=TENSORS, help="comma-separated tensor names")
    ap.add_argument("--variant", default="avx2")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="every linear weight in turn, as a decode step")
    args = ap.parse_args()

    import gguf  # the reader, as the loader uses it

    libs = {
        "base": library(Path(args.base).resolve(), args.variant, Path("/tmp/izh-gguf-ab/base")),
        "this": library(ROOT, args.variant, Path("/tmp/izh-gguf-ab/this")),
    }
    fns = {}
    for name, lib in libs.items():
        fn = lib.izh_gguf_matmul_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, ctypes.c_int]
        fns[name] = fn
    tensors = {t.name: t for t in gguf.GGUFReader(args.gguf).tensors}
    torch.manual_seed(0)
    if args.sweep:
        for m in (int(r) for r in args.rows.split(",")):
            sweep(fns, [t for t in tensors.values() if _linear(t)], m, args.repeats, args.threads)
        return
    print(
        f"{'tensor':24} {'type':5} {'N x K':>12} {'rows':>4} {'base':>10} {'this':>10} {'GMAC/s':>13} {'ratio':>6}"
    )
    for tensor_name in args.tensors.split(","):
        t = tensors[tensor_name]
        k, n = int(t.shape[0]), int(t.shape[1])
        raw = torch.from_numpy(np.array(t.data, copy=True).reshape(n, -1))
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            outs = {name: torch.empty(m, n) for name in fns}
            times: dict[str, list[float]] = {name: [] for name in fns}
            repeats = max(3, args.repeats * 8 // max(m, 8)) if n > 100_000 else args.repeats
            for _ in range(repeats):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    rc = fn(
                        int(t.tensor_type), x.data_ptr(), k, raw.data_ptr(), raw.stride(0), m, n, k,
                        outs[name].data_ptr(), n, args.threads,
                    )  # fmt: skip
                    times[name].append(time.perf_counter() - t0)
                    if rc:
                        raise SystemExit(f"{name}: izh_gguf_matmul_f32 returned {rc} for {tensor_name}")
            base, this = (statistics.median(times[name]) for name in ("base", "this"))
            same = "same bits" if torch.equal(outs["base"], outs["this"]) else "DIFFERENT BITS"
            print(
                f"{tensor_name:24} {t.tensor_type.name:5} {f'{n}x{k}':>12} {m:4d} {base * 1e3:7.3f} ms "
                f"{this * 1e3:7.3f} ms {m * n * k / base / 1e9:6.1f} {m * n * k / this / 1e9:6.1f} "
                f"{base / this:5.2f}x {same}",
                flush=True,
            )


def _linear(t: Any) -> bool:
    """A matmul weight: 2-D, quantized, not the token embedding (gathered, not multiplied by)."""
    quantized = t.tensor_type.name.startswith(("Q", "IQ"))
    return len(t.shape) == 2 and quantized and not t.name.startswith("token_embd")


def sweep(fns: dict[str, Any], weights: list[Any], m: int, repeats: int, threads: int) -> None:
    """Every weight once per pass, the two libraries' passes alternated; medians per block type and in all."""
    raws = [torch.from_numpy(np.array(t.data, copy=True).reshape(int(t.shape[1]), -1)) for t in weights]
    xs = [torch.randn(m, int(t.shape[0])) for t in weights]
    outs = {name: [torch.empty(m, int(t.shape[1])) for t in weights] for name in fns}
    per_type: dict[str, dict[str, list[float]]] = {name: {} for name in fns}
    totals: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in sorted(fns.items(), reverse=r % 2 == 1):  # each goes first in half the passes
            spent: dict[str, float] = {}
            for t, raw, x, out in zip(weights, raws, xs, outs[name], strict=True):
                k, n = int(t.shape[0]), int(t.shape[1])
                t0 = time.perf_counter()
                rc = fn(
                    int(t.tensor_type), x.data_ptr(), k, raw.data_ptr(), raw.stride(0), m, n, k, out.data_ptr(), n,
                    threads,
                )  # fmt: skip
                spent[t.tensor_type.name] = spent.get(t.tensor_type.name, 0.0) + time.perf_counter() - t0
                if rc:
                    raise SystemExit(f"{name}: izh_gguf_matmul_f32 returned {rc} for {t.name}")
            for kind, s in spent.items():
                per_type[name].setdefault(kind, []).append(s)
            totals[name].append(sum(spent.values()))
    same_bits = all(torch.equal(a, b) for a, b in zip(*outs.values(), strict=True))
    same = "same bits" if same_bits else "DIFFERENT BITS"
    print(f"sweep of {len(weights)} weights, {m} rows, {threads} threads: {same}")
    for kind in sorted(per_type["this"]):
        mb = sum(r.numel() for t, r in zip(weights, raws, strict=True) if t.tensor_type.name == kind) / 1e6
        base, this = (statistics.median(per_type[name][kind]) for name in ("base", "this"))
        print(
            f"  {kind:6} {mb:7.1f} MB  base {base * 1e3:7.2f} ms {mb / base / 1e3:5.1f} GB/s  "
            f"this {this * 1e3:7.2f} ms {mb / this / 1e3:5.1f} GB/s  {base / this:5.2f}x"
        )
    base, this = (statistics.median(totals[name]) for name in ("base", "this"))
    print(f"  all    base {base * 1e3:7.2f} ms  this {this * 1e3:7.2f} ms  {base / this:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
