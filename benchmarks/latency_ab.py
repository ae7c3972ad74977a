"""Request latency of two izh checkouts side by side: `izh serve` (default model) from each, started
together, then the same chat requests (random ~100-word prompts, greedy, `max_tokens` 1 and 16)
alternated between them, the order flipped every prompt.

    python benchmarks/latency_ab.py --a /path/to/checkout-a --b /path/to/checkout-b [--prompts 60]

`max_tokens: 1` is the request's cost up to its first token (HTTP, template, tokenizing, admission,
prefill); the 16-token run adds 15 decode steps, so (t16 - t1) / 15 is the cost of a token. Run it with
`--a X --b X` (the same checkout twice) to see the machine's noise floor. Prints medians and writes one
JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, wait_ok  # noqa: E402
from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "music",
    "table",
    "garden",
    "window",
    "paper",
    "light",
    "ocean",
    "forest",
]
MAX_TOKENS = (1, 16)


def _chat_ms(url: str, text: str, max_tokens: int) -> float:
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    ).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", required=True, help="checkout A (its folder goes first on PYTHONPATH)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5, help="prompts left out of the medians")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    servers: dict[str, str] = {}
    procs = []
    try:
        for name, root in (("a", Path(args.a).resolve()), ("b", Path(args.b).resolve())):
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(root)}
            cmd = [sys.executable, "-m", "izh_cli.main", "serve", "--port", str(port)]
            procs.append(
                subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            servers[name] = f"http://127.0.0.1:{port}"
        for proc, url in zip(procs, servers.values(), strict=True):
            wait_ok(f"{url}/health", proc)
        rnd = random.Random(0)
        times: dict[str, dict[int, list[float]]] = {name: {mt: [] for mt in MAX_TOKENS} for name in servers}
        for i in range(args.prompts):
            text = " ".join(rnd.choice(WORDS) for _ in range(100)) + f" {i}"
            order = list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]
            for max_tokens in MAX_TOKENS:
                for name, url in order:
                    times[name][max_tokens].append(_chat_ms(url, f"{text} {max_tokens}", max_tokens))
    finally:
        for proc in procs:
            proc.terminate()
    medians = {
        name: {mt: statistics.median(v[args.warmup :]) for mt, v in per.items()}
        for name, per in times.items()
    }
    for name, per in medians.items():
        per_token = (per[16] - per[1]) / 15
        print(
            f"{name}: max_tokens 1 {per[1]:.2f} ms, max_tokens 16 {per[16]:.2f} ms, per token {per_token:.3f} ms"
        )
    model, flags = cpu_model_and_flags()
    out = Path(args.out or ROOT / "bench_results" / f"latency_ab-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "a": str(args.a),
                "b": str(args.b),
                "cpu": {"model": model, "flags": " ".join(flags)},
                "medians_ms": medians,
                "times_ms": times,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
