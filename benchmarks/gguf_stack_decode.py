"""A GGUF model in its own blocks: 1-stream decode with and without the fused C decode stack, and the
prefill of one long prompt, in one process on one kernel variant.

    flock /tmp/izh-bench.lock nice -n -5 python -m benchmarks.gguf_stack_decode \\
        --model /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --cpu-kernels amx

Decode: one greedy request (--input-len prompt tokens, --output-len new ones), --rounds times with the
stack and without it (`model.fused_stack = None`: every layer through the modules), alternated; the
median per-step decode time of each. Prefill: a --prefill-len-token prompt, 1 new token, --rounds times
(its matmuls run on the AMX tiles from 8-12 rows in the amx variant, on AVX-512 VNNI in avx512: run the
script once per variant). Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.offline_throughput import bench_izh, make_prompts, write_record
from izh import LLM, SamplingParams
from izh.kernels import cpu as cpu_ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cpu-kernels", default="auto")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, cpu_kernels=args.cpu_kernels, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    model = llm.engine_core.runner.model
    stack = model.fused_stack
    if stack is None:
        raise SystemExit("this model does not run the fused decode stack here")
    vocab = model.config.vocab_size
    prompt = make_prompts(1, args.input_len, vocab, seed=0)
    bench_izh(llm, prompt, 8)  # warm up both paths
    model.fused_stack = None
    bench_izh(llm, prompt, 8)
    runs: dict[str, list[dict[str, float]]] = {"stack": [], "modules": []}
    for _ in range(args.rounds):
        for name in runs:
            model.fused_stack = stack if name == "stack" else None
            runs[name].append(bench_izh(llm, prompt, args.output_len))
    model.fused_stack = stack
    long_prompt = make_prompts(1, args.prefill_len, vocab, seed=1)[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prefill_s = []
    for _ in range(args.rounds):
        llm.engine_core.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": long_prompt}], one)
        prefill_s.append(time.perf_counter() - start)
    summary = {
        name: {
            "decode_step_ms": statistics.median(r["decode_step_ms"] for r in rs),
            "output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
        }
        for name, rs in runs.items()
    }
    summary["prefill"] = {"tokens": args.prefill_len, "seconds": statistics.median(prefill_s)}
    print(summary, flush=True)
    write_record(
        "gguf_stack_decode",
        {
            "model": args.model,
            "variant": cpu_ops.variant(),
            "torch_threads": torch.get_num_threads(),
            "args": vars(args),
            "summary": summary,
            "runs": runs,
            "prefill_s": prefill_s,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
