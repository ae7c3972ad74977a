"""The frontend's own cost: `izh serve` on the tiniest model (so the engine is not the bottleneck),
driven by `izh bench` at several concurrencies, next to the offline engine on the same model.

    python benchmarks/frontend_cost.py --concurrency 32,128,256 --output-len 64

Per level it reports streamed tokens/s, median ITL, the same engine's offline decode step time at that
batch size (so ITL minus it is what serving adds), and the CPU time the API process spent per streamed
token (from /proc, so it excludes the engine core process and the benchmark client). Writes one JSON
under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port  # noqa: E402
from benchmarks.offline_throughput import write_record  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise RuntimeError("no engine core process found")


def offline_decode_step_ms(model: str, batch: int, input_len: int, steps: int) -> float:
    """Median decode step of the in-process engine at this batch size (no frontend at all)."""
    from izh import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        llm._add_request(f"offline-{i}", [10 + (i + k) % 200 for k in range(input_len)], params)
    core = llm.engine_core
    times = []
    while core.has_unfinished_requests():
        start = time.perf_counter()
        core.step()
        if core.last_step_is_decode:
            times.append(time.perf_counter() - start)
    llm._drain_finished()
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="32,128,256")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    from tests.fixtures.checkpoints import build_tiny_checkpoint, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="izh-frontend-bench-"))
    model = build_tiny_checkpoint(work / "tiny", "llama", build_tokenizer())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", model, "--port", str(port)]
    cmd += ["--max-num-seqs", str(max(levels)), "--kv-cache-memory-bytes", "256MiB", "--log-level", "warning"]
    # One engine thread, as recorded: the tiny model makes the API the bottleneck, and it needs a core.
    cmd += ["--num-threads", "1"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("izh serve did not start")
            time.sleep(0.2)
        core = core_pid(server.pid)
        dataset = work / "prompt.jsonl"
        words = " ".join(f"word{i}" for i in range(args.input_len // 2))
        dataset.write_text(json.dumps({"prompt": words, "output_tokens": args.output_len}) + "\n")
        for level in levels:
            front0, core0 = cpu_seconds(server.pid), cpu_seconds(core)
            out = work / f"bench-{level}.json"
            bench = [sys.executable, "-m", "izh_cli.main", "bench", "--url", url, "--endpoint", "completions"]
            bench += ["--concurrency", str(level), "--requests", str(level * args.requests_per_stream)]
            # One prompt for every request: the client tokenizes nothing, so the API process's CPU
            # time is the serving path alone.
            bench += ["--dataset", str(dataset), "--output-len", str(args.output_len)]
            bench += ["--ignore-eos", "--json", "--out", str(out)]
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            front_s, core_s = cpu_seconds(server.pid) - front0, cpu_seconds(core) - core0
            run = json.loads(out.read_text())["runs"][0]
            m = run["metrics"]
            tokens = m["total_output_tokens"]
            row = {
                "concurrency": level,
                "output_throughput_tok_s": m["output_throughput"],
                "median_itl_ms": m["median_itl_ms"],
                "p99_itl_ms": m["p99_itl_ms"],
                "median_ttft_ms": m["median_ttft_ms"],
                "failed": m["failed"],
                "frontend_cpu_us_per_token": 1e6 * front_s / tokens,
                "core_cpu_us_per_token": 1e6 * core_s / tokens,
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        server.terminate()
        server.wait(60)
    for row in results:
        level = int(row["concurrency"])  # type: ignore[call-overload]
        row["offline_decode_step_ms"] = offline_decode_step_ms(model, level, args.input_len, 16)
        row["itl_added_by_serving_ms"] = row["median_itl_ms"] - row["offline_decode_step_ms"]  # type: ignore[operator]
        print(json.dumps(row), flush=True)
    write_record(
        "frontend_cost",
        {
            "model": "tiny random llama (tests/fixtures/checkpoints.py)",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
