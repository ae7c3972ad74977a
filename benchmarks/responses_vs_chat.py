"""The Responses API (or Anthropic's Messages API) against chat completions on one `izh serve`: the
same prompts, greedy, sent alternately through POST /v1/chat/completions and POST /v1/responses (and
/ or POST /v1/messages), streamed and not, at several concurrencies, so that what a route adds (its
event stream, items, store; Messages' content blocks and events) shows side by side.

    python benchmarks/responses_vs_chat.py                      # the default model, concurrency 1 and 8
    python benchmarks/responses_vs_chat.py --concurrency 1,8 --requests 16 --max-tokens 128 --rounds 2
    python benchmarks/responses_vs_chat.py --endpoints chat,messages --concurrency 16,64 --stream-only

Greedy decoding of the same messages gives both routes the same tokens (the output token counts are
reported to show it). Per (concurrency, streaming, endpoint): TTFT p50 (first text delta), ITL p50 and
p99 (between text deltas), request latency p50, output tok/s over the batch's wall time, and the API
process's CPU time per output token (from /proc: the engine core and this client excluded). Each
round runs chat then responses then chat ... so drift in the machine's speed hits both. One JSON goes
under bench_results/ (machine, CPU model and flags, command, every batch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port  # noqa: E402
from benchmarks.frontend_cost import cpu_seconds  # noqa: E402
from benchmarks.offline_throughput import write_record  # noqa: E402
from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle gear works.",
    "List five facts about the moon.",
    "Describe a rainy day in a big city.",
    "Give advice to someone learning to cook.",
    "What makes a good friend?",
    "Summarize the plot of a heist movie you invent.",
    "Explain photosynthesis to a child.",
]
ENDPOINTS = ("chat", "responses", "messages")


def _body(
    endpoint: str, prompt: str, max_tokens: int, stream: bool, model: str
) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", body
    if endpoint == "messages":
        return "/v1/messages", {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
    return "/v1/responses", {
        "input": prompt,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "store": False,
    }


async def _one(
    client: httpx.AsyncClient, endpoint: str, prompt: str, max_tokens: int, stream: bool, model: str
) -> dict[str, Any]:
    """One request: its latency, its output tokens, and (streamed) the times of its text deltas."""
    path, body = _body(endpoint, prompt, max_tokens, stream, model)
    start = time.perf_counter()
    if not stream:
        reply = await client.post(path, json=body)
        reply.raise_for_status()
        data = reply.json()
        usage = data["usage"]
        tokens = usage["completion_tokens"] if endpoint == "chat" else usage["output_tokens"]
        return {"latency": time.perf_counter() - start, "tokens": tokens, "deltas": []}
    deltas: list[float] = []
    tokens = 0
    async with client.stream("POST", path, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if endpoint == "chat":
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if any(choice["delta"].get("content") for choice in event["choices"]):
                    deltas.append(now)
            elif endpoint == "messages":
                if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                    deltas.append(now)
                elif event["type"] == "message_delta":
                    tokens = event["usage"]["output_tokens"]
            elif event["type"] == "response.output_text.delta":
                deltas.append(now)
            elif event["type"] in ("response.completed", "response.incomplete"):
                tokens = event["response"]["usage"]["output_tokens"]
    return {"latency": time.perf_counter() - start, "tokens": tokens, "deltas": [d - start for d in deltas]}


async def _batch(
    url: str, endpoint: str, concurrency: int, requests: int, max_tokens: int, stream: bool, model: str = ""
) -> tuple[float, list[dict[str, Any]]]:
    queue = list(range(requests))
    results: list[dict[str, Any]] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            index = queue.pop()
            prompt = PROMPTS[index % len(PROMPTS)]
            results.append(await _one(client, endpoint, prompt, max_tokens, stream, model))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - start, results


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(wall_s: float, results: list[dict[str, Any]], cpu_s: float) -> dict[str, float]:
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["deltas"][0] for r in results if r["deltas"]]
    itl = [b - a for r in results for a, b in zip(r["deltas"], r["deltas"][1:], strict=False)]
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "output_tok_s": tokens / wall_s,
        "latency_p50_ms": 1e3 * statistics.median(r["latency"] for r in results),
        "ttft_p50_ms": 1e3 * _percentile(ttft, 0.5),
        "itl_p50_ms": 1e3 * _percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * _percentile(itl, 0.99),
        "api_cpu_us_per_token": 1e6 * cpu_s / max(tokens, 1),
    }


def _merge(rows: list[dict[str, float]]) -> dict[str, float]:
    """Several rounds of one configuration: medians of each figure."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model for izh serve (default: izh's default model)")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per batch")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternations of chat and responses per setting"
    )
    parser.add_argument(
        "--endpoints", default="chat,responses", help="the routes, alternated: chat, responses, messages"
    )
    parser.add_argument("--stream-only", action="store_true", help="streamed requests only (no JSON runs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    endpoints = tuple(args.endpoints.split(","))
    if not set(endpoints) <= set(ENDPOINTS):
        parser.error(f"--endpoints takes {', '.join(ENDPOINTS)}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "izh_cli.main", "serve", *([args.model] if args.model else [])]
    command += ["--port", str(port)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        log = Path(work) / "serve.log"
        with log.open("wb") as out:
            server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"izh serve did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.5)
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            for endpoint in endpoints:  # warm-up: first requests compile and fill caches
                asyncio.run(_batch(url, endpoint, 2, 2, 8, True, model))
            for level in levels:
                for stream in (True,) if args.stream_only else (True, False):
                    per_endpoint: dict[str, list[dict[str, float]]] = {e: [] for e in endpoints}
                    for _ in range(args.rounds):
                        for endpoint in endpoints:
                            cpu0 = cpu_seconds(server.pid)
                            wall, results = asyncio.run(
                                _batch(url, endpoint, level, args.requests, args.max_tokens, stream, model)
                            )
                            per_endpoint[endpoint].append(
                                _summary(wall, results, cpu_seconds(server.pid) - cpu0)
                            )
                    for endpoint in endpoints:
                        row = {
                            "concurrency": level,
                            "stream": stream,
                            "endpoint": endpoint,
                            **_merge(per_endpoint[endpoint]),
                        }
                        row["rounds"] = per_endpoint[endpoint]
                        rows.append(row)
                        print(
                            f"c={level:<3} {'stream' if stream else 'json  '} {endpoint:<9} "
                            f"tok/s {row['output_tok_s']:8.1f}  TTFT p50 {row['ttft_p50_ms']:8.1f} ms  "
                            f"ITL p50 {row['itl_p50_ms']:6.1f} ms  p99 {row['itl_p99_ms']:7.1f} ms  "
                            f"latency p50 {row['latency_p50_ms']:8.1f} ms  API CPU {row['api_cpu_us_per_token']:6.0f} us/tok  "
                            f"({row['output_tokens']:.0f} tokens)",
                            flush=True,
                        )
        finally:
            server.terminate()
            server.wait(60)
    model, flags = cpu_model_and_flags()
    write_record(
        "_vs_".join(reversed(endpoints)),
        {
            "cpu_model": model,
            "cpu_flags": " ".join(flags),
            "server_command": " ".join(command[1:]),
            "settings": vars(args),
            "results": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
