"""The frontend's own cost: `izh serve` on the tiniest model (so the engine is not the bottleneck),
driven by `izh bench` at several concurrencies, next to the offline engine on the same model.

    python benchmarks/frontend_cost.py --concurrency 32,128,256 --output-len 64

Per level it reports streamed tokens/s, median ITL, the same engine's offline decode step time at that
batch size (so ITL minus it is what serving adds), and the CPU time the API process spent per streamed
token (from /proc, so it excludes the engine core process and the benchmark client), the core's and
the client's (`izh bench`) CPU per token, and the share of the machine's CPU time left idle. Writes one
JSON under bench_results/.

Scale-out (`izh serve --api-server-count N --data-parallel-size M`), configurations alternated round by
round, each server started afresh and alone on the machine:

    python benchmarks/frontend_cost.py --concurrency 256 --api-server-counts 1,2 --rounds 2 --skip-offline
    python benchmarks/frontend_cost.py --concurrency 64 --data-parallel-sizes 1,2 --prefix-len 64 \
        --num-prefixes 8 --rounds 1 --skip-offline

Frontend CPU is then summed over every API process, core CPU over every core.

Routes compared on one server (`--endpoints`, each level runs them in turn, round after round):

    python benchmarks/frontend_cost.py --concurrency 32 --endpoints chat,messages --rounds 3 \
        --no-ignore-eos --skip-offline

(Anthropic's /v1/messages has no ignore_eos, so compare it with chat without it: the same greedy
outputs, the same tokens.) With --prefix-len the
prompts share --num-prefixes distinct prefixes (`izh bench`'s prefix dataset), and each row reports the
data-parallel router's affinity hit rate (izh:dp_routed_requests_total by route) and the cores' prefix
cache hit rate (izh:prefix_cache_hits / queries) over that level.
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


def machine_idle_s() -> float:
    """Idle CPU seconds of the whole machine so far, summed over its CPUs (/proc/stat: idle + iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / os.sysconf("SC_CLK_TCK")


def spawned_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = []
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            found.append(int(child))
    return found


def core_pid(server_pid: int) -> int:
    children = spawned_children(server_pid)
    if not children:
        raise RuntimeError("no engine core process found")
    return children[0]


def process_roles(server_pid: int, url: str, supervised: bool) -> tuple[list[int], list[int]]:
    """(API process pids, engine core pids): the server itself and its core, or the supervisor's
    children told apart by /v1/izh/stats' core pids."""
    if not supervised:
        return [server_pid], [core_pid(server_pid)]
    cores = [int(e["pid"]) for e in httpx.get(f"{url}/v1/izh/stats", timeout=10).json()["engines"]]
    apis = [pid for pid in spawned_children(server_pid) if pid not in cores]
    return apis, cores


def metric_sums(url: str) -> dict[str, float]:
    """The counters a row reports deltas of, summed over their series (route kinds kept apart)."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in (
            "izh:dp_routed_requests_total",
            "izh:prefix_cache_hits_total",
            "izh:prefix_cache_queries_total",
        ):
            if line.startswith(name + "{"):
                key = name
                if name == "izh:dp_routed_requests_total":
                    key += ":" + line.split('route="', 1)[1].split('"', 1)[0]
                sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


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


def run_config(
    model: str, args: argparse.Namespace, levels: list[int], work: Path, api_count: int, dp_size: int
) -> list[dict[str, object]]:
    """Start `izh serve` with this many API processes and cores, run every level, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", model, "--port", str(port)]
    cmd += ["--max-num-seqs", str(max(levels)), "--kv-cache-memory-bytes", "256MiB", "--log-level", "warning"]
    # One engine thread per core, as recorded: the tiny model makes the API the bottleneck, and it needs
    # a CPU core.
    cmd += ["--num-threads", "1"]
    supervised = api_count > 1 or dp_size > 1
    if supervised:
        cmd += ["--api-server-count", str(api_count), "--data-parallel-size", str(dp_size)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: list[dict[str, object]] = []
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
        apis, cores = process_roles(server.pid, url, supervised)
        if args.prefix_len:
            dataset = ["--dataset", "prefix", "--prefix-len", str(args.prefix_len)]
            dataset += ["--num-prefixes", str(args.num_prefixes), "--input-len", str(args.input_len)]
        else:
            path = work / "prompt.jsonl"
            words = " ".join(f"word{i}" for i in range(args.input_len // 2))
            path.write_text(json.dumps({"prompt": words, "output_tokens": args.output_len}) + "\n")
            # One prompt for every request: the client tokenizes nothing, so the API process's CPU
            # time is the serving path alone.
            dataset = ["--dataset", str(path)]
        for level, endpoint in [
            (level, endpoint) for level in levels for endpoint in args.endpoints.split(",")
        ]:
            front0, core0 = sum(map(cpu_seconds, apis)), sum(map(cpu_seconds, cores))
            counters0 = metric_sums(url)
            out = work / f"bench-{api_count}-{dp_size}-{level}-{endpoint}.json"
            bench = [sys.executable, "-m", "izh_cli.main", "bench", "--url", url, "--endpoint", endpoint]
            bench += ["--concurrency", str(level), "--requests", str(level * args.requests_per_stream)]
            bench += [*dataset, "--output-len", str(args.output_len), "--temperature", "0"]
            bench += [] if args.no_ignore_eos else ["--ignore-eos"]
            bench += ["--json", "--out", str(out)]
            idle0, wall0 = machine_idle_s(), time.monotonic()
            client = subprocess.Popen(bench, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, status, usage = os.wait4(client.pid, 0)
            client.returncode = os.waitstatus_to_exitcode(status)
            if client.returncode:
                raise RuntimeError(f"izh bench failed ({client.returncode})")
            idle_share = (machine_idle_s() - idle0) / ((time.monotonic() - wall0) * (os.cpu_count() or 1))
            front_s = sum(map(cpu_seconds, apis)) - front0
            core_s = sum(map(cpu_seconds, cores)) - core0
            counters = {k: v - counters0.get(k, 0.0) for k, v in metric_sums(url).items()}
            run = json.loads(out.read_text())["runs"][0]
            m = run["metrics"]
            tokens = m["total_output_tokens"]
            row: dict[str, object] = {
                "endpoint": endpoint,
                "total_output_tokens": tokens,
                "api_server_count": api_count,
                "data_parallel_size": dp_size,
                "concurrency": level,
                "output_throughput_tok_s": m["output_throughput"],
                "median_itl_ms": m["median_itl_ms"],
                "p99_itl_ms": m["p99_itl_ms"],
                "median_ttft_ms": m["median_ttft_ms"],
                "failed": m["failed"],
                "frontend_cpu_us_per_token": 1e6 * front_s / tokens,
                "core_cpu_us_per_token": 1e6 * core_s / tokens,
                # The load generator's own CPU (izh bench), and how much of the machine stayed idle.
                "client_cpu_us_per_token": 1e6 * (usage.ru_utime + usage.ru_stime) / tokens,
                "machine_idle_share": idle_share,
            }
            routed = {k.split(":")[-1]: v for k, v in counters.items() if k.startswith("izh:dp_routed")}
            if dp_size > 1 and sum(routed.values()):
                row["dp_routes"] = routed
                row["dp_affinity_hit_rate"] = routed.get("affinity", 0.0) / sum(routed.values())
            queries = counters.get("izh:prefix_cache_queries_total", 0.0)
            if queries:
                row["prefix_cache_hit_rate"] = counters.get("izh:prefix_cache_hits_total", 0.0) / queries
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        server.terminate()
        server.wait(60)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="32,128,256")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--api-server-counts", default="1", help="izh serve --api-server-count values, e.g. 1,2")
    ap.add_argument(
        "--data-parallel-sizes", default="1", help="izh serve --data-parallel-size values, e.g. 1,2"
    )
    ap.add_argument("--rounds", type=int, default=1, help="Each configuration this many times, alternated.")
    ap.add_argument(
        "--prefix-len", type=int, default=0, help="Shared prefix tokens (izh bench's prefix dataset)."
    )
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--skip-offline", action="store_true", help="No offline decode-step comparison.")
    ap.add_argument(
        "--endpoints",
        default="completions",
        help="izh bench --endpoint values run in turn: completions,chat,messages",
    )
    ap.add_argument(
        "--no-ignore-eos", action="store_true", help="Let requests end at EOS (needed for messages)."
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    configs = [
        (int(a), int(d))
        for a in args.api_server_counts.split(",")
        for d in args.data_parallel_sizes.split(",")
    ]

    from tests.fixtures.checkpoints import build_tiny_checkpoint, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="izh-frontend-bench-"))
    model = build_tiny_checkpoint(work / "tiny", "llama", build_tokenizer())
    results: list[dict[str, object]] = []
    for round_index in range(args.rounds):
        for api_count, dp_size in configs:
            for row in run_config(model, args, levels, work, api_count, dp_size):
                row["round"] = round_index
                results.append(row)
    if not args.skip_offline:
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
            "prefix_len": args.prefix_len,
            "num_prefixes": args.num_prefixes if args.prefix_len else None,
            "endpoints": args.endpoints,
            "ignore_eos": not args.no_ignore_eos,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
