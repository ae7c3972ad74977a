"""Decode steps of many streams over long contexts, per KV cache format (`engine.kv_cache_dtype`).

    flock /tmp/izh-bench.lock nice -n -5 python -m benchmarks.kv_cache_dtype \\
        --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --cpu-kernels avx2 \\
        --kv float32,bfloat16,q8_0 --streams 32 --context 1000

Per format: an engine (`LLM`) with that KV cache; one real prefill of --context tokens into the first
sequence's blocks, copied into every other stream's blocks (the same context for all: attention reads
every stream's blocks anyway); then --steps decode steps of all --streams at once through the model (the
fused C decode stack) and the LM head, each timed. The formats are alternated over --rounds; the result is
each format's median step time and its output tokens per second (streams / step), and the ratio to the
first format. Per format also the decode attention kernel alone (`paged_decode_attention` over one layer's
cache, the same streams and context, times the model's layers): the part of a step the format can change.
Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.offline_throughput import make_prompts, write_record
from izh import LLM
from izh.kernels import cpu as cpu_ops
from izh.model.attention import AttentionMetadata


def stream_tables(streams: int, context: int, steps: int, block_size: int) -> list[list[int]]:
    """Each stream's block table: its own consecutive blocks, enough for `context` + `steps` + 1 tokens."""
    per_seq = -(-(context + steps + 1) // block_size)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(streams)]


def decode_steps(llm: LLM, streams: int, context: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `streams` sequences at `context` tokens and more."""
    runner = llm.engine_core.runner
    model, bs = runner.model, runner.block_size
    tables = stream_tables(streams, context, steps, bs)
    prompt = torch.tensor(make_prompts(1, context, runner.vocab_size, seed=0)[0])
    with torch.inference_mode():
        meta = AttentionMetadata.from_block_tables([context], [context], [tables[0]], bs)
        model(prompt, torch.arange(context), meta)
        first = torch.tensor(tables[0])
        for cache in {id(c): c for c in runner.kv_caches}.values():
            raw = cache.view(torch.uint8)  # every format, byte for byte
            for table in tables[1:]:
                raw[:, torch.tensor(table)] = raw[:, first]
        logits = torch.empty(streams, runner.vocab_size)
        times = []
        for t in range(steps):
            ids = torch.randint(100, runner.vocab_size, (streams,))
            positions = torch.full((streams,), context + t)
            meta = AttentionMetadata.from_block_tables([1] * streams, [context + t + 1] * streams, tables, bs)
            start = time.perf_counter()
            hidden = model(ids, positions, meta)
            model.compute_logits(hidden, out=logits)
            times.append(time.perf_counter() - start)
    return times


def attention_steps(llm: LLM, streams: int, context: int, steps: int) -> list[float]:
    """Seconds of the decode attention alone of a step like `decode_steps`' (one layer's cache, random
    q/k/v of the model's shapes, timed once per layer count), `steps` times."""
    runner = llm.engine_core.runner
    mc, bs = runner.model_config, runner.block_size
    cache = runner.kv_caches[0]
    tables = torch.tensor(stream_tables(streams, context, steps, bs), dtype=torch.int32)
    heads, kv_heads, d, dtype = mc.num_attention_heads, runner.num_local_kv_heads, mc.head_dim, runner.dtype
    gen = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        for t in range(steps):
            q = torch.randn(streams, heads, d, generator=gen).to(dtype)
            k = torch.randn(streams, kv_heads, d, generator=gen).to(dtype)
            v = torch.randn(streams, kv_heads, d, generator=gen).to(dtype)
            slots = tables[:, (context + t) // bs].long() * bs + (context + t) % bs
            lens = torch.full((streams,), context + t + 1, dtype=torch.int32)
            start = time.perf_counter()
            for _ in range(mc.num_hidden_layers):
                cpu_ops.paged_decode_attention(q, k, v, cache, slots, tables, lens, d**-0.5)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cpu-kernels", default="auto")
    ap.add_argument("--kv", default="float32,bfloat16,q8_0", help="formats, the first the baseline")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    formats = args.kv.split(",")
    times: dict[str, list[float]] = {kv: [] for kv in formats}
    attention: dict[str, list[float]] = {kv: [] for kv in formats}
    info: dict[str, dict[str, object]] = {}
    for _ in range(args.rounds):
        for kv in formats:
            llm = LLM(
                args.model,
                cpu_kernels=args.cpu_kernels,
                kv_cache_dtype=kv,
                max_model_len=args.context + args.steps + 16,
                max_num_seqs=args.streams,
                kv_cache_memory_bytes=2 << 30,
                enable_prefix_caching=False,
            )
            runner = llm.engine_core.runner
            assert runner.model.fused_stack is not None, "decodes should run the fused C stack"
            info[kv] = {
                "variant": cpu_ops.variant(),
                "format": runner.kv_format.name,
                "bytes_per_token": runner.kv_bytes_per_token(),
                "tokens_per_gib": runner.kv_tokens_per_gib(),
            }
            step_s = decode_steps(llm, args.streams, args.context, args.steps + 1)[1:]  # the first warms up
            times[kv] += step_s
            attn_s = attention_steps(llm, args.streams, args.context, args.steps + 1)[1:]
            attention[kv] += attn_s
            print(
                f"{kv}: median step {statistics.median(step_s) * 1e3:.1f} ms, "
                f"attention alone {statistics.median(attn_s) * 1e3:.1f} ms",
                flush=True,
            )
            del llm, runner
            gc.collect()
    base = statistics.median(times[formats[0]])
    results = {}
    for kv in formats:
        median = statistics.median(times[kv])
        results[kv] = {
            **info[kv],
            "median_step_s": median,
            "output_tok_s": args.streams / median,
            "speedup_vs_" + formats[0]: base / median,
            "step_s": times[kv],
            "median_attention_s": statistics.median(attention[kv]),
            "attention_share_of_step": statistics.median(attention[kv]) / median,
            "attention_s": attention[kv],
        }
        print(f"{kv}: {args.streams / median:.1f} tok/s, {base / median:.2f}x {formats[0]}")
    write_record(
        "kv_cache_dtype",
        {
            "model": args.model,
            "cpu_kernels": args.cpu_kernels,
            "streams": args.streams,
            "context": args.context,
            "torch_threads": torch.get_num_threads(),
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
