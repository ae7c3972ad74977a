"""Where a draft model's speculative step spends its time: the target's step of M single-token rows
(M = 1 .. k + 1: a decode, and a verification of k drafts), the draft's decode step and LM head, and one
greedy generation with the draft model timed by part (drafting rounds, verification steps).

    flock /tmp/izh-bench.lock nice -n -5 python -m benchmarks.spec_decode_profile \
        --model /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --draft /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

The row timings run each model's own forward (the fused C stack where it applies, as the engine's steps do)
and its LM head on dummy KV (the cache's first blocks) at `--context` positions, the median of --repeats.
Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.offline_throughput import write_record
from benchmarks.spec_decode import WRITE_PROMPTS, _messages


def _rows_ms(runner, rows: int, context: int, repeats: int, logits: bool) -> float:
    """Median ms of one step of `rows` single-token decodes (one sequence, consecutive positions)."""
    from izh.model.attention import AttentionMetadata

    bs = runner.block_size
    table = list(range((context + rows) // bs + 1))
    positions = list(range(context, context + rows))
    meta = AttentionMetadata.from_block_tables([1] * rows, [p + 1 for p in positions], [table] * rows, bs)
    ids = torch.full((rows,), 100, dtype=torch.long)
    pos = torch.tensor(positions, dtype=torch.long)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            hidden = runner.model(ids, pos, meta)
            if logits:
                runner.model.compute_logits(hidden, out=runner.logits_buffer(rows))
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def _head_ms(runner, repeats: int) -> float:
    hidden = torch.randn(1, runner.model_config.hidden_size)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            runner.model.compute_logits(hidden, out=runner.logits_buffer(1))
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None, help="without: the target's row timings only")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the generation")
    ap.add_argument("--draft-p-min", type=float, default=0.0)
    ap.add_argument("--max-rows", type=int, default=9)
    ap.add_argument("--rows", default=None, help="comma-separated row counts instead of 1 .. --max-rows")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cpu-kernels", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from izh import LLM, SamplingParams
    from izh.config import SpeculativeConfig

    spec = (
        SpeculativeConfig(
            method="draft_model",
            model=args.draft,
            num_speculative_tokens=args.k,
            draft_p_min=args.draft_p_min,
        )
        if args.draft
        else None
    )
    llm = LLM(
        args.model,
        speculative=spec,
        max_model_len=2048,
        cpu_kernels=args.cpu_kernels,
        kv_cache_memory_bytes=512 << 20,
    )
    core = llm.engine_core
    target, draft = core.runner, core.draft
    rows = {
        m: round(_rows_ms(target, m, args.context, args.repeats, logits=True), 2)
        for m in ([int(r) for r in args.rows.split(",")] if args.rows else range(1, args.max_rows + 1))
    }
    print("target step of M rows (ms):", rows, flush=True)
    fields: dict[str, object] = {
        "model": args.model,
        "draft": args.draft,
        "context": args.context,
        "cpu_kernels": args.cpu_kernels,
        "target_rows_ms": rows,
        "target_lm_head_ms": round(_head_ms(target, args.repeats), 2),
    }
    if draft is None:
        write_record("spec_decode_profile", fields, args.out)
        return
    draft_rows = {
        m: round(_rows_ms(draft.runner, m, args.context, args.repeats, logits=True), 2) for m in (1, 2)
    }
    print("draft step (ms):", draft_rows, flush=True)

    # One generation, timed by part.
    spent = {"propose": 0.0, "execute": 0.0}
    calls = {"propose": 0, "execute": 0}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1

        return wrapper

    draft.propose = timed("propose", draft.propose)
    target.execute = timed("execute", target.execute)
    forwards = {"n": 0}
    draft_forward = draft._forward

    def counted(*a, **kw):
        forwards["n"] += 1
        return draft_forward(*a, **kw)

    draft._forward = counted
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    out = llm.chat([_messages(WRITE_PROMPTS[0])], params)
    wall = time.perf_counter() - start
    n = len(out[0].outputs[0].token_ids)
    stats = core.make_stats()
    generation = {
        "tokens": n,
        "wall_s": round(wall, 3),
        "tok_s": round(n / wall, 2),
        "propose_s": round(spent["propose"], 3),
        "propose_calls": calls["propose"],
        "draft_forwards": forwards["n"],
        "execute_s": round(spent["execute"], 3),
        "execute_calls": calls["execute"],
        "num_drafts": stats.spec_decode_num_drafts,
        "num_draft_tokens": stats.spec_decode_num_draft_tokens,
        "num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "accepted_per_pos": stats.spec_decode_num_accepted_tokens_per_pos,
    }
    print("generation:", json.dumps(generation), flush=True)
    fields |= {
        "k": args.k,
        "draft_p_min": args.draft_p_min,
        "draft_rows_ms": draft_rows,
        "draft_lm_head_ms": round(_head_ms(draft.runner, args.repeats), 2),
        "generation": generation,
    }
    write_record("spec_decode_profile", fields, args.out)


if __name__ == "__main__":
    main()
