"""Offline throughput of the izh engine vs transformers' generate(), side by side in one run.

    python benchmarks/offline_throughput.py --batch-sizes 1,8,32,128 --input-len 128 --output-len 128

Both run the same weights (the default SmolLM2 GGUF, dequantized for transformers) in the same dtype
on this machine; izh may also use its packed int4/int8 copies of them for small batches (--quantization).
Writes one JSON under bench_results/ (git sha, command, machine, torch version, results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from izh_cli.bench.report import cpu_model_and_flags

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_info() -> dict[str, object]:
    cpu = cpu_model_and_flags()[0]
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "izh"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def write_record(benchmark: str, fields: dict[str, object], out: str | None) -> Path:
    """Save one run as JSON (benchmark name, git sha, command, machine, then `fields`); returns the path.

    Default path: bench_results/<benchmark>-<timestamp>.json.
    """
    record = {
        "benchmark": benchmark,
        "git_sha": git_sha(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        **fields,
    }
    path = Path(out) if out else ROOT / "bench_results" / f"{benchmark}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def make_prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Avoid the first ids (special tokens on most vocabularies).
    return torch.randint(100, vocab_size, (batch, input_len), generator=g).tolist()


def bench_izh(llm, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from izh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = llm.engine_core
    for i, p in enumerate(prompts):
        llm._add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    num_steps = 0
    forward_s = 0.0
    decode_steps = 0
    decode_total_s = 0.0
    decode_forward_s = 0.0
    start = time.perf_counter()
    num_out = 0
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - t0
        num_steps += 1
        forward_s += core.last_forward_s
        num_out += sum(len(o.new_token_ids) for o in outputs)
        if core.last_step_is_decode:
            decode_steps += 1
            decode_total_s += dt
            decode_forward_s += core.last_forward_s
    elapsed = time.perf_counter() - start
    llm._drain_finished()
    return {
        "elapsed_s": elapsed,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "steps": num_steps,
        "decode_steps": decode_steps,
        "decode_step_ms": 1e3 * decode_total_s / max(decode_steps, 1),
        "decode_forward_ms": 1e3 * decode_forward_s / max(decode_steps, 1),
        "decode_other_ms": 1e3 * (decode_total_s - decode_forward_s) / max(decode_steps, 1),
    }


def bench_hf(model, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    input_ids = torch.tensor(prompts)
    attention_mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    num_out = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tok_s": num_out / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="izh's dtype; transformers runs the one izh resolved")
    ap.add_argument("--quantization", default="auto", help="izh's weight packing (auto|none|int4|int8)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (izh only)")
    ap.add_argument("--hf-max-batch", type=int, default=32, help="largest batch run through transformers")
    ap.add_argument("--out", default=None, help="result JSON path (default bench_results/...)")
    args = ap.parse_args()

    from izh import LLM
    from izh_cli.progress import ProgressBar

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    t0 = time.perf_counter()
    with ProgressBar() as progress:
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            max_model_len=args.input_len + args.output_len + 16,
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(2048, args.input_len),
            kv_cache_memory_bytes=None,
            enable_prefix_caching=False,
            progress=progress,
        )
    load_s = time.perf_counter() - t0
    rss_after_load = peak_rss_mib()
    vocab = llm.engine_core.vocab_size
    runner = llm.engine_core.runner
    dtype = runner.dtype  # what "auto" resolved to: transformers runs the same
    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = Path(llm.model_path)
        hf_model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, torch_dtype=dtype
        ).eval()

    results = []
    bench_izh(llm, make_prompts(2, 16, vocab, 0), 4)  # warm-up
    for batch in batch_sizes:
        prompts = make_prompts(batch, args.input_len, vocab, seed=batch)
        row: dict[str, object] = {"batch": batch, "izh": bench_izh(llm, prompts, args.output_len)}
        if hf_model is not None and batch <= args.hf_max_batch:
            row["transformers"] = bench_hf(hf_model, prompts, args.output_len)
            row["speedup_vs_transformers"] = (
                row["izh"]["output_tok_s"] / row["transformers"]["output_tok_s"]  # type: ignore[index]
            )
        results.append(row)
        print(json.dumps(row), flush=True)

    write_record(
        "offline_throughput",
        {
            "model": args.model,
            "dtype": str(dtype).removeprefix("torch."),
            "quantization": runner.quantization,
            "num_threads": torch.get_num_threads(),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "load_s": load_s,
            "peak_rss_after_load_mib": rss_after_load,
            "peak_rss_mib": peak_rss_mib(),
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
