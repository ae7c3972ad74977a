"""`izh bench --endpoint embeddings`: requests/s, inputs/s and input tokens/s of POST /v1/embeddings
(and, `--endpoint rerank`, of POST /v1/rerank: one query against `batch_size` documents per request).

Plain OpenAI /v1/embeddings (JSON floats, as `encoding_format` "float"), so it measures vLLM and
llama.cpp (`llama-server --embeddings`) servers as well as izh. Each request carries `batch_size` of
the dataset's texts; `concurrency` requests are kept in flight. Input tokens come from each reply's
usage (the prompt lengths the dataset measured where a server sends none).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from izh_cli.bench.metrics import percentile

if TYPE_CHECKING:
    import httpx
    from rich.table import Table

    from izh_cli.bench.datasets import Sample


@dataclass(slots=True)
class EmbeddingRecord:
    """One /v1/embeddings request's outcome."""

    index: int
    start_s: float
    latency_s: float
    num_inputs: int
    input_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    batch: list[Sample],
    index: int,
    origin: float,
    encoding_format: str,
    rerank: bool = False,
) -> EmbeddingRecord:
    import httpx

    from izh_cli.http import error_message, exception_kind, http_error_kind

    body: dict[str, Any] = {
        "model": model,
        "input": [s.prompt for s in batch],
        "encoding_format": encoding_format,
    }
    if rerank:  # the query is the batch's first text, the documents all of it
        body = {"model": model, "query": batch[0].prompt, "documents": [s.prompt for s in batch]}
    start = time.perf_counter()
    error = None
    tokens = sum(s.prompt_len for s in batch)
    try:
        response = await client.post(url, json=body)
        if response.status_code != 200:
            error = http_error_kind(
                response.status_code, error_message(response.content, response.reason_phrase)
            )
        else:
            payload = response.json()
            data = payload.get("results" if rerank else "data") if isinstance(payload, dict) else None
            if not isinstance(data, list) or len(data) != len(batch):
                what = "results" if rerank else "embeddings"
                error = f"bad reply: {len(data) if isinstance(data, list) else 'no'} {what} for {len(batch)} inputs"
            usage = payload.get("usage") if isinstance(payload, dict) else None
            key = "total_tokens" if rerank else "prompt_tokens"
            if isinstance(usage, dict) and isinstance(usage.get(key), int) and usage[key]:
                tokens = usage[key]
    except httpx.HTTPError as exc:
        error = exception_kind(exc)
    except ValueError as exc:
        error = f"bad reply: {exc}"
    end = time.perf_counter()
    return EmbeddingRecord(index, start - origin, end - start, len(batch), tokens, error)


async def run_level(
    clients: list[httpx.AsyncClient],
    url: str,
    model: str,
    samples: list[Sample],
    *,
    concurrency: int,
    num_requests: int,
    batch_size: int,
    stop: asyncio.Event | None = None,
    encoding_format: str = "float",
    rerank: bool = False,
) -> tuple[list[EmbeddingRecord], float, bool]:
    """Send `num_requests` requests of `batch_size` texts (cycling through `samples`), `concurrency` at
    a time; returns the records, the wall time and whether `stop` cut it short. `encoding_format`
    "base64" is what the openai SDK asks for by default (vLLM and llama.cpp serve it too)."""
    texts = itertools.cycle(samples)
    batches = [[next(texts) for _ in range(batch_size)] for _ in range(num_requests)]
    queue = iter(enumerate(batches))
    records: list[EmbeddingRecord] = []
    origin = time.perf_counter()

    async def worker(slot: int) -> None:
        client = clients[slot % len(clients)]
        for index, batch in queue:
            if stop is not None and stop.is_set():
                return
            records.append(await _one(client, url, model, batch, index, origin, encoding_format, rerank))

    tasks = [asyncio.create_task(worker(slot)) for slot in range(min(concurrency, num_requests))]
    stopper = asyncio.create_task(stop.wait()) if stop is not None else None
    try:
        pending: set[asyncio.Task[Any]] = set(tasks)
        while pending:
            waiting = pending | ({stopper} if stopper is not None else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if stopper is not None and stopper in done:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        if stopper is not None:
            stopper.cancel()
    duration = time.perf_counter() - origin
    return sorted(records, key=lambda r: r.index), duration, bool(stop is not None and stop.is_set())


def metrics(records: list[EmbeddingRecord], duration_s: float) -> dict[str, Any]:
    """Throughput (requests, inputs and input tokens per second) and latency percentiles (ms)."""
    ok = [r for r in records if r.ok]
    latencies = sorted(r.latency_s * 1000 for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(duration_s, 4),
        "request_throughput": round(per_s(len(ok)), 3),
        "input_throughput": round(per_s(sum(r.num_inputs for r in ok)), 3),
        "input_token_throughput": round(per_s(sum(r.input_tokens for r in ok)), 2),
        "total_input_tokens": sum(r.input_tokens for r in ok),
        "mean_latency_ms": round(sum(latencies) / len(latencies), 3) if latencies else None,
        "median_latency_ms": round(percentile(latencies, 50), 3) if latencies else None,
        "p99_latency_ms": round(percentile(latencies, 99), 3) if latencies else None,
    }


def errors(records: list[EmbeddingRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            counts[r.error] = counts.get(r.error, 0) + 1
    return counts


def run_entry(
    concurrency: int, batch_size: int, records: list[EmbeddingRecord], duration_s: float, interrupted: bool
) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "batch_size": batch_size,
        "metrics": metrics(records, duration_s),
        "errors": errors(records),
        "interrupted": interrupted,
        "requests": [asdict(r) for r in records],
    }


def table(runs: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    t = Table(title="Embeddings Benchmark Result")
    for column in (
        "concurrency",
        "inputs/req",
        "ok",
        "failed",
        "req/s",
        "inputs/s",
        "input tok/s",
        "p50 ms",
        "p99 ms",
    ):
        t.add_column(column, justify="right")
    for run in runs:
        m = run["metrics"]

        def fmt(value: Any) -> str:
            if value is None or (isinstance(value, float) and math.isnan(value)):
                return "-"
            return f"{value:,.2f}" if isinstance(value, float) else str(value)

        t.add_row(
            str(run["concurrency"]),
            str(run["batch_size"]),
            str(m["completed"]),
            str(m["failed"]),
            fmt(m["request_throughput"]),
            fmt(m["input_throughput"]),
            fmt(m["input_token_throughput"]),
            fmt(m["median_latency_ms"]),
            fmt(m["p99_latency_ms"]),
        )
    return t
