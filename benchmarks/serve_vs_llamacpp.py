"""izh serve against llama.cpp's llama-server on the same GGUF and machine, runs alternated.

    python benchmarks/serve_vs_llamacpp.py --llama-server ~/.cache/izh-peers/llama-server \
        --gguf ~/.cache/izh/models/SmolLM2-135M-Instruct.Q4_1.gguf --rounds 2

Both servers are started once and stay up (llama-server with 32 slots, unified KV, continuous batching
and one thread per core: `-np 32 -kvu -cb -t N`); the load levels run through `izh bench` (streaming
chat, `ignore_eos`), alternating the two servers level by level and round by round, while the other
server sits idle. Each level reports the median over the rounds of total output tok/s, TTFT p50 and ITL
p50/p99. One JSON goes under bench_results/ (machine, CPU model and flags, commands, every run) and a
table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, wait_ok  # noqa: E402
from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402

LEVELS = [
    # (name, concurrency, requests, input tokens, output tokens)
    ("1 stream", 1, 6, 126, 128),
    ("8 streams", 8, 24, 126, 128),
    ("32 streams", 32, 64, 126, 128),
    ("8 streams, ~1,000-token prompts", 8, 16, 1000, 128),
    # issue 27's KV cache dtype comparison: one wave of 32 long-context streams
    ("32 streams, ~1,000-token prompts", 32, 32, 1000, 64),
]


def _cpu() -> dict[str, str]:
    """The CPU model and its flags (first processor)."""
    model, flags = cpu_model_and_flags()
    return {"model": model, "flags": " ".join(flags)}


def _bench(
    url: str, level: tuple[str, int, int, int, int], izh: str, seed: int, alias: str
) -> dict[str, float]:
    _name, conc, requests, input_len, output_len = level
    cmd = [
        izh, "bench", "--url", url, "--endpoint", "chat", "--concurrency", str(conc), "--requests",
        str(requests), "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos",
        "--json", "--out", "/tmp/serve_vs_llamacpp-bench.json", "--model", alias, "--seed", str(seed),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"izh bench failed ({run.returncode}): {run.stderr[-2000:]}")
    m = json.loads(run.stdout)["runs"][0]["metrics"]
    return {
        "output_tok_s": float(m["output_throughput"]),
        "ttft_p50_ms": float(m["median_ttft_ms"]),
        "itl_p50_ms": float(m["median_itl_ms"]),
        "itl_p99_ms": float(m["p99_itl_ms"]),
        "completed": float(m["completed"]),
        "failed": float(m["failed"]),
    }


def _sha(checkout: str) -> str:
    run = subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return run.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", default=str(Path("~/.cache/izh-peers/llama-server").expanduser()))
    parser.add_argument(
        "--gguf", default=str(Path("~/.cache/izh/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser())
    )
    parser.add_argument(
        "--alias",
        default="smollm2",
        help="the model name both servers answer to (izh bench's prompts are sized by the server's /tokenize)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="round r sends prompts of seed SEED + r (new prompts every round: "
        "both servers cache prefixes), the servers' order reversed when that is odd",
    )
    parser.add_argument(
        "--levels", default="0,1,2,3", help="comma list of level indexes (0-4; 4: 32 long streams) or all"
    )
    parser.add_argument("--izh-arg", action="append", default=[], help="extra `izh serve` argument")
    parser.add_argument(
        "--llama-arg", action="append", default=[], help="extra llama-server argument (e.g. -ctk q8_0)"
    )
    parser.add_argument("--izh-only", action="store_true", help="skip llama-server (tuning izh alone)")
    parser.add_argument(
        "--baseline",
        default=None,
        help="a checkout of izh at another commit (e.g. `git worktree add /tmp/base <sha>`): its "
        "`izh serve` joins the alternation as izh@base, run from this venv with PYTHONPATH=BASELINE",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    izh = shutil.which("izh") or str(Path(sys.executable).with_name("izh"))
    threads = str(os.cpu_count() or 1)
    levels = LEVELS if args.levels == "all" else [LEVELS[int(i)] for i in args.levels.split(",")]
    izh_port, llama_port = free_port(), free_port()
    izh_cmd = [izh, "serve", args.gguf, "--served-model-name", args.alias, "--port", str(izh_port), "--log-level", "warning", *args.izh_arg]  # fmt: skip
    llama_cmd = [
        args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(llama_port), "-a", args.alias,
        "-c", "65536", "-np", "32", "-kvu", "-cb", "-t", threads, "-tb", threads, "--no-webui", *args.llama_arg,
    ]  # fmt: skip
    base_port = free_port()
    base_cmd = [sys.executable, "-m", "izh_cli.main", *izh_cmd[1:]]
    base_cmd[base_cmd.index("--port") + 1] = str(base_port)
    base_env = {**os.environ, "PYTHONPATH": str(Path(args.baseline or ".").resolve())}
    procs = []
    runs: list[dict] = []
    try:
        started: list[tuple[str, list[str], int, dict[str, str] | None, str | None]] = [
            ("izh", izh_cmd, izh_port, None, None)
        ]
        if args.baseline:
            # Started from the baseline's folder: `python -m` puts the working directory first on
            # sys.path, ahead of PYTHONPATH, so from here it would import this checkout's izh.
            started.append(("izh@base", base_cmd, base_port, base_env, str(Path(args.baseline).resolve())))
        if not args.izh_only:
            started.append(("llama.cpp", llama_cmd, llama_port, None, None))
        servers = {}
        for name, cmd, port, env, cwd in started:
            log = open(f"/tmp/serve_vs_llamacpp-{port}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd
                )
            )
            wait_ok(f"http://127.0.0.1:{port}/health", procs[-1])
            servers[name] = f"http://127.0.0.1:{port}/v1"
        for r in range(args.rounds):
            seed = args.seed + r
            for level in levels:
                order = list(servers.items()) if seed % 2 == 0 else list(servers.items())[::-1]
                for name, url in order:
                    summary = _bench(url, level, izh, seed, args.alias)
                    runs.append({"round": r, "seed": seed, "level": level[0], "server": name, **summary})
                    print(json.dumps(runs[-1]), flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    table = []
    for level in levels:
        row: dict[str, object] = {"level": level[0]}
        for name in ("izh", "izh@base", "llama.cpp"):
            mine = [x for x in runs if x["level"] == level[0] and x["server"] == name]
            if not mine:
                mine = [
                    dict.fromkeys(("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"), float("nan"))
                ]
            for key in ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"):
                row[f"{name} {key}"] = statistics.median(x[key] for x in mine)
        row["ratio"] = float(row["izh output_tok_s"]) / float(row["llama.cpp output_tok_s"])  # type: ignore[arg-type]
        row["ratio_to_base"] = float(row["izh output_tok_s"]) / float(row["izh@base output_tok_s"])  # type: ignore[arg-type]
        table.append(row)
    result = {
        "benchmark": "serve_vs_llamacpp",
        "git_sha": _sha(str(Path(__file__).resolve().parent)),  # this checkout: the izh under test
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "cpu": _cpu()},
        "izh_command": izh_cmd,
        "izh_env": {key: value for key, value in os.environ.items() if key.startswith("IZH_")},
        "llama_command": llama_cmd,
        "baseline": (
            {"dir": args.baseline, "command": base_cmd, "git_sha": _sha(args.baseline)}
            if args.baseline
            else None
        ),
        "levels": [list(level) for level in levels],
        "summary": table,
        "runs": runs,
    }
    out = Path(args.out or f"bench_results/serve_vs_llamacpp-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}\n")
    print(
        f"{'load':34} {'izh tok/s':>10} {'llama tok/s':>11} {'ratio':>6} {'TTFT p50 izh/llama':>20} {'ITL p50 izh/llama':>18} {'ITL p99 izh/llama':>18}"
    )
    for row in table:
        print(
            f"{row['level']:34} {row['izh output_tok_s']:10.1f} {row['llama.cpp output_tok_s']:11.1f} "
            f"{row['ratio']:6.2f} {row['izh ttft_p50_ms']:9.0f}/{row['llama.cpp ttft_p50_ms']:<9.0f}ms "
            f"{row['izh itl_p50_ms']:7.1f}/{row['llama.cpp itl_p50_ms']:<7.1f}ms "
            f"{row['izh itl_p99_ms']:7.0f}/{row['llama.cpp itl_p99_ms']:<7.0f}ms"
        )
    if args.baseline:
        print(f"\n{'load':34} {'izh tok/s':>10} {'base tok/s':>10} {'ratio':>6} {'ITL p50 izh/base':>18}")
        for row in table:
            print(
                f"{row['level']:34} {row['izh output_tok_s']:10.1f} {row['izh@base output_tok_s']:10.1f} "
                f"{row['ratio_to_base']:6.2f} {row['izh itl_p50_ms']:7.1f}/{row['izh@base itl_p50_ms']:<7.1f}ms"
            )


if __name__ == "__main__":
    main()
