"""The C paged attention of one prefill chunk at a given context: time and GFLOP/s, per activation dtype
(the cache in that dtype), or per KV cache format with float32 activations (`--kv`).

    flock /tmp/izh-bench.lock nice -n -5 python -m benchmarks.prefill_attention --contexts 1024,4096,16384,30000
    python -m benchmarks.prefill_attention --contexts 4096 --kv float32,bfloat16,float16,fp8_e4m3,q8_0

One sequence of `--heads` query heads over `--kv-heads` KV heads of `--head-dim` (Qwen2.5-0.5B's 14 / 2 / 64 by
default) holds `context` tokens in the paged cache (filled by untimed calls); then a chunk of `--chunk` new
tokens attends to it (`cpu_ops.paged_attention`, the call a prefill chunk makes per layer), the fastest of
`--repeats`. A chunk's attention is 4 * head_dim * heads * chunk * (context + chunk / 2) FLOP (q . k and the
weighted sum of v, each a multiply-add). Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.offline_throughput import write_record
from izh.kernels import cpu as cpu_ops
from izh.kernels.kv_cache_dtype import kv_cache_format
from izh_cli.bench.report import cpu_model_and_flags

BLOCK = 16


def chunk_seconds(
    context: int,
    chunk: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int,
    kv: str = "auto",
) -> float:
    gen = torch.Generator().manual_seed(0)
    num_blocks = (context + chunk) // BLOCK + 2
    fmt = kv_cache_format(kv, dtype)
    row = fmt.row_size(head_dim)
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, row, dtype=fmt.storage)
    tables = torch.arange(num_blocks, dtype=torch.int32)[None]

    def call(start: int, n: int) -> float:
        q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.arange(start, start + n, dtype=torch.int64)
        lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        rows = torch.zeros(n, dtype=torch.int32)
        began = time.perf_counter()
        cpu_ops.paged_attention(q, k, v, cache, slots, tables, rows, lens, head_dim**-0.5)
        return time.perf_counter() - began

    for start in range(0, context, 512):
        call(start, min(512, context - start))
    return min(call(context, chunk) for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384,30000")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--kv",
        default=None,
        help="KV cache formats to time (engine.kv_cache_dtype names), with float32 activations; "
        "replaces --dtypes",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    cases = (
        [("float32", kv) for kv in args.kv.split(",")]
        if args.kv
        else [(name, "auto") for name in args.dtypes.split(",")]
    )
    for name, kv in cases:
        dtype = getattr(torch, name)
        for context in (int(c) for c in args.contexts.split(",")):
            seconds = chunk_seconds(
                context, args.chunk, args.heads, args.kv_heads, args.head_dim, dtype, args.repeats, kv
            )
            flop = 4 * args.head_dim * args.heads * args.chunk * (context + args.chunk / 2)
            row = {
                "dtype": name,
                "kv": kv,
                "context": context,
                "ms": seconds * 1e3,
                "gflop_s": flop / seconds / 1e9,
            }
            print(row, flush=True)
            results.append(row)
    write_record(
        "prefill_attention",
        {
            "cpu_flags": cpu_model_and_flags()[1],
            "variant": cpu_ops.variant(),
            "torch_threads": torch.get_num_threads(),
            "args": vars(args),
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
