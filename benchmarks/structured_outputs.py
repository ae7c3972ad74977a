"""The cost of structured outputs: JSON-schema-constrained decoding vs free decoding, side by side.

    python benchmarks/structured_outputs.py --batch 32 --input-len 64 --output-len 64

Three measurements on the same model (the default SmolLM2 GGUF, dequantized) in one run:

- decode throughput at one batch size, every request constrained by a typical JSON schema vs the
  same prompts unconstrained (no `ignore_eos`, same `max_tokens`). Constrained requests end when
  their JSON does, free ones when they emit EOS, so the comparison uses only the decode steps in
  which the whole batch decodes, at the same positions in every run: median time per step, and
  tokens/s over those steps (batch / step time);
- the schema's compile time through GrammarManager (add_request until is_ready): first compile,
  and a second request with the same spec (the LRU cache);
- the per-step cost of bitmask fill + apply for the whole batch, replaying the constrained run's
  tokens through fresh matchers so the masks are computed in the states decoding really visits.

Writes one JSON under bench_results/ (git sha, command, machine, torch version, results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.offline_throughput import make_prompts, write_record  # noqa: E402

# Typed properties, an enum, a bounded array, a nested object, required fields.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 4, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{2,12}@[a-z]{2,12}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "bio": {"type": "string", "minLength": 16, "maxLength": 200},
    },
    "required": ["name", "age", "email", "role", "active", "tags", "address", "bio"],
    "additionalProperties": False,
}
# Polling interval while waiting for a compile in the worker thread (the resolution of compile_ms).
_POLL_S = 50e-6


def _spec(schema: dict[str, Any]):  # -> StructuredOutputsParams
    from izh.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=json.dumps(schema))


def bench_compile(tokenizer, vocab_size: int, schema: dict[str, Any], repeats: int) -> dict[str, float]:
    """Compile time through a fresh GrammarManager: the first request, then requests with the same
    spec (cached). Runs before anything else compiled this schema in the process."""
    from izh.engine.guided import GrammarManager

    t0 = time.perf_counter()
    manager = GrammarManager(tokenizer, vocab_size)
    tokenizer_s = time.perf_counter() - t0

    def time_ready(request_id: str) -> float:
        start = time.perf_counter()
        manager.add_request(request_id, _spec(schema))
        while not manager.is_ready(request_id):
            time.sleep(_POLL_S)
        return time.perf_counter() - start

    first_s = time_ready("first")
    cached = [time_ready(f"cached-{i}") for i in range(repeats)]
    errors = [manager.error(r) for r in ["first", *(f"cached-{i}" for i in range(repeats))]]
    assert not any(errors), errors
    manager.shutdown()
    return {
        "grammar_tokenizer_build_ms": 1e3 * tokenizer_s,
        "first_compile_ms": 1e3 * first_s,
        "cached_compile_ms_median": 1e3 * statistics.median(cached),
        "cached_compile_ms_max": 1e3 * max(cached),
        "cached_repeats": repeats,
    }


def bench_decode(llm, prompts: list[list[int]], output_len: int, spec) -> dict[str, Any]:
    """Run the batch to completion; time the decode steps in which the whole batch decodes."""
    from izh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, structured_outputs=spec)
    core = llm.engine_core
    request_ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        llm._add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    finish: dict[str, str | None] = {}
    full_steps_s: list[float] = []
    full_forward_s = 0.0
    num_out = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - t0
        num_decoded = 0
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            num_decoded += bool(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason
        num_out += sum(len(o.new_token_ids) for o in outputs)
        if core.last_step_is_decode and num_decoded == len(prompts):
            full_steps_s.append(dt)
            full_forward_s += core.last_forward_s
    elapsed = time.perf_counter() - start
    llm._drain_finished()
    n = max(len(full_steps_s), 1)
    step_s = sum(full_steps_s) / n
    lengths = [len(t) for t in tokens.values()]
    reasons = [finish.get(r) for r in request_ids]
    return {
        "full_batch_decode_steps": len(full_steps_s),
        "decode_step_ms": 1e3 * step_s,
        "decode_step_ms_median": 1e3 * statistics.median(full_steps_s) if full_steps_s else 0.0,
        "decode_forward_ms": 1e3 * full_forward_s / n,
        "decode_other_ms": 1e3 * (sum(full_steps_s) - full_forward_s) / n,
        "decode_tok_s": len(prompts) / step_s if full_steps_s else 0.0,
        "elapsed_s": elapsed,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "output_len_mean": statistics.mean(lengths),
        "output_len_min": min(lengths),
        "finish_reasons": {reason or "none": reasons.count(reason) for reason in set(reasons)},
        "_token_ids": [tokens[r] for r in request_ids],
        "_full_steps_s": full_steps_s,
    }


def bench_bitmask(tokenizer, vocab_size: int, spec, token_ids: list[list[int]]) -> dict[str, float]:
    """Per-step fill_bitmask + apply_bitmask for the whole batch, replaying `token_ids` (one list per
    request) through fresh matchers; only steps where every request still decodes count."""
    from izh.engine.guided import GrammarManager, apply_bitmask

    manager = GrammarManager(tokenizer, vocab_size, max_num_rows=len(token_ids))
    request_ids = [f"r{i}" for i in range(len(token_ids))]
    for request_id in request_ids:
        manager.add_request(request_id, spec)
    for request_id in request_ids:
        while not manager.is_ready(request_id):
            time.sleep(_POLL_S)
    logits = torch.randn(len(token_ids), vocab_size)  # [batch, vocab_size]
    fill_s: list[float] = []
    apply_s: list[float] = []
    num_steps = min(len(t) for t in token_ids)
    for step in range(num_steps):
        t0 = time.perf_counter()
        bitmask = manager.fill_bitmask(list(request_ids))
        t1 = time.perf_counter()
        assert bitmask is not None
        apply_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        for request_id, tokens in zip(request_ids, token_ids, strict=True):
            assert manager.accept_tokens(request_id, [tokens[step]]), manager.error(request_id)
    manager.shutdown()
    return {
        "steps": num_steps,
        "fill_ms_mean": 1e3 * statistics.mean(fill_s),
        "fill_ms_median": 1e3 * statistics.median(fill_s),
        "fill_ms_max": 1e3 * max(fill_s),
        "apply_ms_mean": 1e3 * statistics.mean(apply_s),
        "apply_ms_median": 1e3 * statistics.median(apply_s),
        "fill_plus_apply_ms_mean": 1e3 * (statistics.mean(fill_s) + statistics.mean(apply_s)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2, help="alternating free/constrained runs of each")
    ap.add_argument("--out", default=None, help="result JSON path (default bench_results/...)")
    args = ap.parse_args()

    from izh import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.input_len),
        kv_cache_memory_bytes=None,
        enable_prefix_caching=False,
    )
    core = llm.engine_core
    vocab = core.vocab_size
    spec = _spec(SCHEMA)

    # First: nothing in this process has compiled the schema yet.
    compile_row = bench_compile(llm.tokenizer, vocab, SCHEMA, repeats=20)
    print(json.dumps({"compile": compile_row}), flush=True)

    # Warm-up: the model, and the engine's grammar manager (its tokenizer build) on another schema.
    warm = make_prompts(2, 16, vocab, 0)
    warm_spec = _spec({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0.0, max_tokens=4))
    llm.generate(
        [{"prompt_token_ids": p} for p in warm],
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=warm_spec),
    )

    prompts = make_prompts(args.batch, args.input_len, vocab, seed=args.batch)
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "json_schema": []}
    step_times: dict[str, list[list[float]]] = {"free": [], "json_schema": []}
    token_ids: list[list[int]] = []
    for _ in range(args.repeats):
        for name, run_spec in (("free", None), ("json_schema", spec)):
            row = bench_decode(llm, prompts, args.output_len, run_spec)
            ids = row.pop("_token_ids")
            step_times[name].append(row.pop("_full_steps_s"))
            if run_spec is not None:
                token_ids = ids
            runs[name].append(row)
            print(json.dumps({name: row}), flush=True)
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks

    bitmask_row = bench_bitmask(llm.tokenizer, vocab, spec, token_ids)
    print(json.dumps({"bitmask": bitmask_row}), flush=True)

    # Compare the same decode positions: the first `num_common` full-batch steps of every run (the
    # free runs lose their full batch at the first EOS). Median per run, then the fastest repeat:
    # other jobs on a shared machine only ever add time.
    num_common = min(len(times) for per_mode in step_times.values() for times in per_mode)
    assert num_common > 0, "no decode step had the whole batch decoding"

    def step_ms(name: str) -> float:
        return min(1e3 * statistics.median(times[:num_common]) for times in step_times[name])

    free_ms, constrained_ms = step_ms("free"), step_ms("json_schema")
    summary = {
        "compared_decode_steps": num_common,
        "decode_step_ms_free": free_ms,
        "decode_step_ms_json_schema": constrained_ms,
        "decode_tok_s_free": 1e3 * args.batch / free_ms,
        "decode_tok_s_json_schema": 1e3 * args.batch / constrained_ms,
        "json_schema_over_free_tok_s": free_ms / constrained_ms,
        "bitmask_fill_plus_apply_ms": bitmask_row["fill_ms_median"] + bitmask_row["apply_ms_median"],
        "first_compile_ms": compile_row["first_compile_ms"],
        "cached_compile_ms": compile_row["cached_compile_ms_median"],
    }
    print(json.dumps({"summary": summary}), flush=True)
    write_record(
        "structured_outputs",
        {
            "model": args.model,
            "dtype": args.dtype,
            "batch": args.batch,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "schema": SCHEMA,
            "summary": summary,
            "compile": compile_row,
            "decode": runs,
            "decode_full_batch_step_ms": {
                name: [[1e3 * t for t in times] for times in per_mode]
                for name, per_mode in step_times.items()
            },
            "bitmask": bitmask_row,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
