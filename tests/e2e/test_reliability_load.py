"""Load against a real `izh serve` (spawned core, tiny model): 256 concurrent streams at the admission
limit all succeed, waves of them leave the memory of both processes flat, requests above the limit
are refused at once with 503 + Retry-After (never left to time out), and afterwards every KV block
is free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tests.e2e.test_reliability_lifecycle import all_blocks_free, launch, stop
from tests.e2e.test_serve import Served, _wait_for

CONCURRENCY = 256
"""Streams at once, and the server's admission limit (max_requests_in_flight)."""
NUM_ABOVE = 64
MAX_TOKENS = 8
NUM_WAVES = 3
RSS_GROWTH_LIMIT_BYTES = 16 * 2**20
"""What waves after the warm-up may add to either process (a leak of a few KB per request shows)."""
CLIENT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def served(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    started = launch(
        tiny_llama_dir,
        tmp_path_factory.mktemp("load"),
        "--kv-cache-memory-bytes",
        "32MiB",
        "--max-requests-in-flight",
        str(CONCURRENCY),
        "--max-num-seqs",
        str(CONCURRENCY),
        "--engine-heartbeat-timeout-s",
        "300",
        "--log-level",
        "warning",
    )
    yield started
    stop(started)


@dataclass
class Outcome:
    status: int
    num_chunks: int = 0
    finish_reason: str | None = None
    num_errors: int = 0
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.num_errors and self.finish_reason == "length"


def _body(index: int) -> dict[str, object]:
    return {"prompt": f"request {index}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}


async def _read(reply: httpx.Response) -> Outcome:
    outcome = Outcome(reply.status_code)
    try:
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                outcome.num_errors += 1
            else:
                outcome.num_chunks += 1
                outcome.finish_reason = chunk["choices"][0]["finish_reason"] or outcome.finish_reason
    finally:
        await reply.aclose()
    return outcome


async def _open(client: httpx.AsyncClient, url: str, index: int) -> httpx.Response:
    request = client.build_request("POST", f"{url}/v1/completions", json=_body(index))
    return await client.send(request, stream=True)


def _client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=CONCURRENCY + NUM_ABOVE, max_keepalive_connections=CONCURRENCY)
    return httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits)


async def _wave(url: str) -> list[Outcome]:
    async with _client() as client:

        async def one(index: int) -> Outcome:
            return await _read(await _open(client, url, index))

        return await asyncio.gather(*(one(i) for i in range(CONCURRENCY)))


def _rss(served: Served) -> tuple[int, int]:
    return psutil.Process(served.proc.pid).memory_info().rss, psutil.Process(
        served.core_pid
    ).memory_info().rss


def test_concurrent_streams_at_the_limit_all_succeed_and_memory_stays_flat(served: Served) -> None:
    assert all(outcome.ok for outcome in asyncio.run(_wave(served.url)))  # warm-up
    warm = _rss(served)
    for _ in range(NUM_WAVES - 1):
        outcomes = asyncio.run(_wave(served.url))
        failed = [outcome for outcome in outcomes if not outcome.ok]
        assert not failed, failed[:5]
        assert all(outcome.num_chunks >= 1 for outcome in outcomes)
    after = _rss(served)
    print(f"RSS after warm-up {warm}, after {NUM_WAVES - 1} more waves of {CONCURRENCY}: {after}")
    for before, now in zip(warm, after, strict=True):
        assert now - before < RSS_GROWTH_LIMIT_BYTES, (warm, after)
    _wait_for(lambda: all_blocks_free(served), 30, "every KV block to be free")


def test_above_the_admission_limit_requests_get_503_at_once_not_timeouts(served: Served) -> None:
    # A stopped core makes no progress, so exactly CONCURRENCY requests stay admitted.
    core = served.core_pid
    os.kill(core, signal.SIGSTOP)
    try:
        outcomes, refused = asyncio.run(_hold_and_overflow(served.url, core))
    finally:
        os.kill(core, signal.SIGCONT)
    print(f"{len(outcomes)} admitted streams, {len(refused)} refused with {sorted(set(refused))}")
    assert refused == [(503, "1", "overloaded")] * NUM_ABOVE
    failed = [outcome for outcome in outcomes if not outcome.ok]
    assert not failed, failed[:5]
    _wait_for(lambda: all_blocks_free(served), 30, "every KV block to be free")


async def _hold_and_overflow(url: str, core: int) -> tuple[list[Outcome], list[tuple[int, str, str]]]:
    async with _client() as client:
        held = await asyncio.gather(*(_open(client, url, i) for i in range(CONCURRENCY)))
        assert [reply.status_code for reply in held] == [200] * CONCURRENCY  # admitted, headers sent

        async def overflow(index: int) -> tuple[int, str, str]:
            reply = await client.post(f"{url}/v1/completions", json=_body(index))
            return reply.status_code, reply.headers.get("retry-after", ""), reply.json()["error"]["code"]

        refused = await asyncio.gather(*(overflow(CONCURRENCY + i) for i in range(NUM_ABOVE)))
        os.kill(core, signal.SIGCONT)  # let the admitted ones run to their end
        outcomes = await asyncio.gather(*(_read(reply) for reply in held))
    return list(outcomes), list(refused)
