"""The operator's view under load: how fast /health, /metrics, /v1/izh/stats and `izh inspect --once`
answer while `izh serve` (the default model) streams 32 chat requests.

    python benchmarks/ops_latency.py                      # decode phase, then a long-prompt phase
    python benchmarks/ops_latency.py --core-nice 5        # the same with the engine core reniced

Phases (each one `izh bench` subprocess at --concurrency): "decode" (short prompts, long outputs: many
small decode steps) and "long_prompts" (~1,000-token prompts: long prefill steps). Meanwhile one
thread per endpoint polls it (GET, 10 s timeout, --poll-interval apart) and another runs
`izh inspect --url ... --once --json --interval --inspect-interval` back to back. Reports p50, p99
and max latency and the count per phase; inspect's row is its whole subprocess (Python start-up and
the --inspect-interval sleep between its two scrapes included) and its "overhead" row subtracts the
sleep. Writes one JSON under bench_results/ (command, git sha, machine with the CPU model and flags
from /proc/cpuinfo, results) and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port  # noqa: E402
from benchmarks.offline_throughput import write_record  # noqa: E402
from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402

ENDPOINTS = ("/health", "/metrics", "/v1/izh/stats")
REQUEST_TIMEOUT_S = 10.0


def cpu_info() -> dict[str, Any]:
    """The CPU model, its flags and the core count (/proc/cpuinfo; Linux)."""
    model, flags = cpu_model_and_flags()
    return {"cpu_model": model or None, "cpu_flags": flags, "cpu_count": os.cpu_count()}


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50, p99 (nearest rank), max and count, in milliseconds."""
    if not values:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]

    return {"count": len(ordered), "p50_ms": rank(0.5), "p99_ms": rank(0.99), "max_ms": 1e3 * ordered[-1]}


class Recorder:
    """Latencies (seconds) and failures per (phase, probe); `phase` is switched by the main thread."""

    def __init__(self) -> None:
        self.phase = "startup"
        self.stop = threading.Event()
        self.latencies: dict[tuple[str, str], list[float]] = {}
        self.failures: dict[tuple[str, str], list[str]] = {}
        self.stats_ages: dict[str, list[float]] = {}
        self.inspect_notes: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def add(self, probe: str, seconds: float) -> None:
        with self._lock:
            self.latencies.setdefault((self.phase, probe), []).append(seconds)

    def fail(self, probe: str, why: str) -> None:
        with self._lock:
            self.failures.setdefault((self.phase, probe), []).append(why)

    def add_age(self, age: float) -> None:
        with self._lock:
            self.stats_ages.setdefault(self.phase, []).append(age)

    def note(self, text: str) -> None:
        with self._lock:
            self.inspect_notes.setdefault(self.phase, []).append(text)


def poll_endpoint(url: str, path: str, interval_s: float, rec: Recorder) -> None:
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        while not rec.stop.is_set():
            start = time.perf_counter()
            try:
                response = client.get(f"{url}{path}")
                elapsed = time.perf_counter() - start
                if response.status_code != 200:
                    rec.fail(path, f"HTTP {response.status_code}")
                else:
                    rec.add(path, elapsed)
                    if path == "/v1/izh/stats":
                        age = response.json().get("stats_age_s")
                        if isinstance(age, int | float):
                            rec.add_age(float(age))
            except httpx.HTTPError as exc:
                rec.fail(path, type(exc).__name__)
            rec.stop.wait(interval_s)


def poll_inspect(url: str, interval_s: float, rec: Recorder) -> None:
    cmd = [sys.executable, "-m", "izh_cli.main", "inspect", "--url", url, "--once", "--json"]
    cmd += ["--interval", str(interval_s)]
    while not rec.stop.is_set():
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        elapsed = time.perf_counter() - start
        try:
            snap = json.loads(done.stdout)
        except ValueError:
            rec.fail("inspect --once", f"exit {done.returncode}: {done.stderr.strip()[-200:]}")
            continue
        if not snap.get("up"):
            rec.fail("inspect --once", f"down: {snap.get('error')}")
            continue
        rec.add("inspect --once", elapsed)
        rec.add("inspect --once overhead", max(elapsed - interval_s, 0.0))
        for note in snap.get("notes") or []:
            rec.note(note)


def wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError("izh serve did not start")
        time.sleep(0.3)


def core_pid(server_pid: int) -> int | None:
    """The engine core: the server's spawned child that is not multiprocessing's resource tracker."""
    for pid in Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"multiprocessing" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    return None


def renice_all_threads(pid: int, niceness: int) -> None:
    """Linux nice values are per thread: set every thread of the process (torch's included)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(task), niceness)


def bench_phase(
    url: str, args: argparse.Namespace, work: Path, name: str, requests: int, input_len: int, output_len: int
) -> dict[str, Any]:
    out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "izh_cli.main", "bench", "--url", url, "--endpoint", "chat"]
    cmd += ["--concurrency", str(args.concurrency), "--requests", str(requests)]
    cmd += ["--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos"]
    cmd += ["--timeout", str(args.request_timeout)]
    cmd += ["--seed", "1" if name == "long_prompts" else "0", "--json", "--out", str(out)]
    start = time.monotonic()
    done = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = json.loads(out.read_text())["runs"][0] if out.exists() else {"metrics": {}, "errors": {}}
    metrics = {**run["metrics"], "exit_code": done.returncode, "errors": run.get("errors", {})}
    keep = (
        "exit_code",
        "errors",
        "completed",
        "failed",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    return {
        "duration_s": time.monotonic() - start,
        "command": " ".join(cmd[2:]),
        **{k: metrics.get(k) for k in keep},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="izh serve's model (default: its default, smollm2)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64, help="requests of the decode phase")
    ap.add_argument("--long-requests", type=int, default=32, help="requests of the long-prompt phase")
    ap.add_argument("--decode-input-len", type=int, default=128)
    ap.add_argument("--decode-output-len", type=int, default=96)
    ap.add_argument("--long-input-len", type=int, default=1000)
    ap.add_argument("--long-output-len", type=int, default=16)
    ap.add_argument("--poll-interval", type=float, default=0.25, help="seconds between an endpoint's polls")
    ap.add_argument("--inspect-interval", type=float, default=0.2, help="inspect --once --interval")
    ap.add_argument("--core-nice", type=int, default=None, help="renice the engine core's threads to this")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `izh serve` argument (repeat)")
    ap.add_argument("--serve-env", action="append", default=[], help="KEY=VALUE for `izh serve` (repeat)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="izh bench --timeout")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="izh-ops-latency-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "izh_cli.main", "serve", *([args.model] if args.model else [])]
    serve += ["--port", str(port), "--log-level", "warning", *args.serve_arg]
    env = {**os.environ, **dict(item.split("=", 1) for item in args.serve_env)}
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    rec = Recorder()
    phases: dict[str, Any] = {}
    try:
        wait_healthy(url, server)
        core = core_pid(server.pid)
        if args.core_nice is not None and core is not None:
            renice_all_threads(core, args.core_nice)
        pollers = [
            threading.Thread(target=poll_endpoint, args=(url, p, args.poll_interval, rec)) for p in ENDPOINTS
        ]
        pollers.append(threading.Thread(target=poll_inspect, args=(url, args.inspect_interval, rec)))
        for thread in pollers:
            thread.start()
        # SIGTERM (a `timeout` around this script) stops the phase under way and still writes the JSON.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        for name, requests, input_len, output_len in (
            ("decode", args.requests, args.decode_input_len, args.decode_output_len),
            ("long_prompts", args.long_requests, args.long_input_len, args.long_output_len),
        ):
            rec.phase = name
            try:
                phases[name] = bench_phase(url, args, work, name, requests, input_len, output_len)
            except (KeyboardInterrupt, SystemExit):
                phases[name] = {"interrupted": True}
                break
            print(f"{name}: {json.dumps(phases[name])}", flush=True)
        rec.phase = "done"
        rec.stop.set()
        for thread in pollers:
            thread.join(90)
    finally:
        rec.stop.set()
        server.terminate()
        server.wait(60)

    probes = (*ENDPOINTS, "inspect --once", "inspect --once overhead")
    results = {
        name: {
            probe: {
                **percentiles(rec.latencies.get((name, probe), [])),
                "failures": rec.failures.get((name, probe), []),
            }
            for probe in probes
        }
        for name in phases
    }
    for name in phases:
        results[name]["stats_age_s"] = percentiles(rec.stats_ages.get(name, []))
        results[name]["inspect_notes"] = sorted(set(rec.inspect_notes.get(name, [])))
    write_record(
        "ops_latency",
        {
            "cpu": cpu_info(),
            "serve_command": " ".join(serve[2:]),
            "serve_env": args.serve_env,
            "core_nice": args.core_nice,
            "concurrency": args.concurrency,
            "poll_interval_s": args.poll_interval,
            "inspect_interval_s": args.inspect_interval,
            "phases": phases,
            "results": results,
        },
        args.out,
    )
    print(f"\n{'phase':<13} {'probe':<24} {'count':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'fail':>4}")
    for name in phases:
        for probe in (*probes, "stats_age_s"):
            r = results[name][probe]
            cells = [
                f"{r[k]:8.1f}" if r[k] is not None else f"{'-':>8}" for k in ("p50_ms", "p99_ms", "max_ms")
            ]
            label = "stats age (s→ms)" if probe == "stats_age_s" else probe
            print(f"{name:<13} {label:<24} {r['count']:>5} {' '.join(cells)} {len(r.get('failures', [])):>4}")


if __name__ == "__main__":
    main()
