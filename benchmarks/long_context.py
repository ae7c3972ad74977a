"""One long prompt arriving while a few streams decode: its TTFT, and the streams' inter-token gaps before
and during its prefill, on izh serve and (optionally) llama.cpp's llama-server, one after the other.

    flock /tmp/izh-bench.lock nice -n -5 python -m benchmarks.long_context \\
        --gguf /work/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --prompt-len 32000 --context 32768 --streams 4 \\
        --izh-arg=--kv-cache-dtype --izh-arg=q8_0 --llama-server ~/.cache/izh-peers/llama-server \\
        --llama-arg=-ctk --llama-arg=q8_0 --llama-arg=-ctv --llama-arg=q8_0

Per server: --streams streaming completions (short prompts, --stream-tokens tokens each, at most 900,
ignore_eos) start, each followed by another as soon as it ends, so that --streams decode throughout;
after --warm-s seconds the long prompt (--prompt-len token ids, 1 output token) is sent. Reported: the long
prompt's TTFT; the streams' inter-token gaps (p50, p99) before it was sent ("alone") and between its send
and its first token ("during"). A server that is still prefilling when --timeout-s passes is reported as
timed out. --context is each server's context (izh's --max-model-len; llama-server's per-slot share): the
prompt plus 1,024 by default, at most the model's (Qwen2.5's 32,768: a 32,000-token prompt fits it).
Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, wait_ok  # noqa: E402
from benchmarks.offline_throughput import write_record  # noqa: E402
from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _stream(
    client: httpx.AsyncClient, url: str, alias: str, prompt: list[int], tokens: int, times: list[float]
) -> list[float]:
    """Appends the arrival time of each streamed chunk of one completion to `times` (kept when the task
    is cancelled), and returns it."""
    body = {
        "model": alias, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
        "ignore_eos": True,
    }  # fmt: skip
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return times


async def _keep_streaming(
    client: httpx.AsyncClient,
    url: str,
    alias: str,
    prompt: list[int],
    tokens: int,
    requests: list[list[float]],
) -> None:
    """One decoding stream for as long as the task runs: a completion of `tokens` tokens, and another as
    soon as it ends (a stream outlasts a long prefill whatever its length); each request's arrival times
    go to a list of their own in `requests`."""
    while True:
        requests.append([])
        await _stream(client, url, alias, prompt, tokens, requests[-1])


async def _scenario(url: str, alias: str, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    vocab_lo, vocab_hi = 1000, 30000
    long_prompt = [rng.randrange(vocab_lo, vocab_hi) for _ in range(args.prompt_len)]
    shorts = [[rng.randrange(vocab_lo, vocab_hi) for _ in range(32)] for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=args.timeout_s + 60) as client:
        per_stream: list[list[list[float]]] = [[] for _ in shorts]  # stream -> its requests' arrival times
        streams = [
            asyncio.create_task(_keep_streaming(client, url, alias, p, args.stream_tokens, requests))
            for p, requests in zip(shorts, per_stream, strict=True)
        ]
        await asyncio.sleep(args.warm_s)
        sent = time.monotonic()
        try:
            first = await asyncio.wait_for(_stream(client, url, alias, long_prompt, 1, []), args.timeout_s)
            ttft = first[0] - sent if first else None
        except TimeoutError:
            first, ttft = [], None
        done = time.monotonic()
        for task in streams:
            task.cancel()
        for task in streams:
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task  # its arrival times so far are kept in `per_stream`
    arrivals = [times for requests in per_stream for times in requests]  # gaps within a request only
    alone, during, longest = [], [], []
    for times in arrivals:
        for a, b in itertools.pairwise(times):
            if b < sent and a > sent - args.warm_s / 2:
                alone.append(b - a)
            elif a >= sent and b <= done:
                during.append(b - a)
                longest.append((b - a, a - sent))
    longest.sort(reverse=True)
    return {
        "ttft_s": ttft,
        "timed_out": ttft is None,
        "itl_alone_p50_ms": None if not alone else 1e3 * statistics.median(alone),
        "itl_alone_p99_ms": None if not alone else 1e3 * (_percentile(alone, 0.99) or 0),
        "itl_during_p50_ms": None if not during else 1e3 * statistics.median(during),
        "itl_during_p99_ms": None if not during else 1e3 * (_percentile(during, 0.99) or 0),
        "itl_during_max_ms": None if not during else 1e3 * max(during),
        "itl_during_mean_ms": None if not during else 1e3 * statistics.fmean(during),
        "gaps_alone": len(alone),
        "gaps_during": len(during),
        "tokens_during_per_stream": [
            sum(sent <= t <= done for times in requests for t in times) for requests in per_stream
        ],
        # the 5 longest gaps during the prefill: (seconds, seconds after the long prompt was sent)
        "longest_gaps_during": [[round(g, 3), round(at, 3)] for g, at in longest[:5]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--alias", default="model")
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=100000)
    ap.add_argument("--warm-s", type=float, default=15.0)
    ap.add_argument("--timeout-s", type=float, default=420.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--izh-arg", action="append", default=[], help="extra `izh serve` argument")
    ap.add_argument("--llama-server", default=None, help="also run llama-server (its path)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument")
    ap.add_argument("--context", type=int, default=None, help="max model length (default: prompt + 1024)")
    ap.add_argument("--skip-izh", action="store_true", help="run llama-server only (a peer's baseline)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    izh = shutil.which("izh") or str(Path(sys.executable).with_name("izh"))
    threads = str(os.cpu_count() or 1)
    context = args.context or args.prompt_len + 1024
    if args.prompt_len >= context:
        raise SystemExit(f"--prompt-len {args.prompt_len} leaves no room in --context {context}")
    stream_cap = min(args.stream_tokens, 900)
    args.stream_tokens = stream_cap
    if args.skip_izh and not args.llama_server:
        raise SystemExit("--skip-izh needs --llama-server")
    servers = []
    port = free_port()
    if not args.skip_izh:
        servers.append((
            "izh",
            [izh, "serve", args.gguf, "--served-model-name", args.alias, "--port", str(port), "--log-level",
             "warning", "--max-model-len", str(context), *args.izh_arg],
            port,
        ))  # fmt: skip
    if args.llama_server:
        port = free_port()
        servers.append((
            "llama.cpp",
            [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-a", args.alias,
             "-c", str(context + args.streams * 1024), "-np", str(args.streams + 1), "-kvu", "-cb", "-t", threads,
             "-tb", threads, "--no-webui", *args.llama_arg],
            port,
        ))  # fmt: skip
    results = {}
    for name, cmd, port in servers:
        log = open(f"/tmp/long_context-{port}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_ok(f"http://127.0.0.1:{port}/health", proc, 600)
            results[name] = asyncio.run(_scenario(f"http://127.0.0.1:{port}", args.alias, args))
            print(name, json.dumps(results[name]), flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    model, flags = cpu_model_and_flags()
    write_record(
        "long_context",
        {
            "cpu": {"model": model, "flags": " ".join(flags)},
            "commands": {name: cmd for name, cmd, _ in servers},
            "args": vars(args),
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
