"""What sampling settings cost per decode step, side by side with the implementations they replaced.

    python benchmarks/sampling_cost.py --batch 32 --output-len 48

SmolLM2 (default settings), `--batch` requests of 128 random prompt tokens decoding together; the median
decode step for greedy, temperature, top-p, top-k and min-p requests. Each setting also runs with the
previous implementation patched back in, in the same process, so the ratio is measured on the same machine
state: greedy through torch.max instead of the C argmax, random rows through torch's softmax and a
float64 cumulative sum (`izh.kernels.cpu.sample_rows_ref`) instead of the one-pass C sampler, and top-p
through torch's histogram-and-candidates path (`_apply_top_p_torch`) instead of the C kernel. (The
recorded run sampling_cost-20261129-133035 compared, with the code of its day, against the exponential
race and a full-vocabulary sort for top-p.) Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.offline_throughput import make_prompts, write_record  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top_k 50": {"temperature": 0.8, "top_k": 50},
    "min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
}


@contextmanager
def previous_algorithms() -> Iterator[None]:
    from izh.engine import sampler
    from izh.kernels import cpu as cpu_ops

    saved = (cpu_ops.argmax_rows, cpu_ops.sample_rows, sampler._apply_top_p)
    cpu_ops.argmax_rows = cpu_ops.argmax_rows_ref
    cpu_ops.sample_rows = cpu_ops.sample_rows_ref
    sampler._apply_top_p = sampler._apply_top_p_torch
    try:
        yield
    finally:
        cpu_ops.argmax_rows, cpu_ops.sample_rows, sampler._apply_top_p = saved


def median_decode_step_ms(llm: Any, prompts: list[list[int]], params: Any) -> float:
    core = llm.engine_core
    for i, prompt in enumerate(prompts):
        llm._add_request(f"s{time.monotonic_ns()}-{i}", prompt, params)
    steps = []
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        core.step()
        if core.last_step_is_decode:
            steps.append(time.perf_counter() - t0)
    llm._drain_finished()
    return 1e3 * statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from izh import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=args.batch, enable_prefix_caching=False)
    prompts = make_prompts(args.batch, 128, llm.engine_core.vocab_size, seed=0)
    median_decode_step_ms(llm, prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    results = []
    for name, fields in SETTINGS.items():
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=None, **fields)
        row: dict[str, Any] = {"setting": name, "step_ms": median_decode_step_ms(llm, prompts, params)}
        with previous_algorithms():
            row["previous_step_ms"] = median_decode_step_ms(llm, prompts, params)
        results.append(row)
        print(json.dumps(row), flush=True)
    write_record(
        "sampling_cost",
        {
            "model": args.model,
            "dtype": str(llm.engine_core.runner.dtype).removeprefix("torch."),
            "batch": args.batch,
            "input_len": 128,
            "output_len": args.output_len,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
