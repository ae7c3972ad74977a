"""Over HTTP with the openai client, on a packed GGUF model (int4 records, float32): the same seeded `n: 3`
request twice gives the same three samples, alone and while other requests run; a greedy request's
logprobs are the same alone and under load (docs/operations.md, "Batch invariance")."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from izh.config import EngineConfig
from izh.kernels import cpu as cpu_ops
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny-q4"
pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the packed path needs izh's C kernels")


@pytest.fixture(scope="module")
def server(tiny_gguf_factory) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_gguf_factory("llama", "Q4_1"),
        served_model_name=MODEL,
        device="cpu",
        max_model_len=128,
        kv_cache_memory_bytes=8 << 20,
    )
    with api_server(config) as started:
        yield started


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _seeded(client: openai.OpenAI) -> list[tuple[str, list[float]]]:
    reply = client.completions.create(
        model=MODEL,
        prompt="the quick brown fox jumps over",
        n=3,
        seed=1234,
        temperature=1.0,
        max_tokens=12,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    choices = sorted(reply.choices, key=lambda c: c.index)
    return [(c.text, list(c.logprobs.token_logprobs)) for c in choices]  # type: ignore[union-attr, arg-type]


def _background(client: openai.OpenAI, i: int) -> None:
    client.completions.create(
        model=MODEL,
        prompt=f"request {i} " * (1 + 3 * i),
        max_tokens=24,
        temperature=0.7,
        extra_body={"ignore_eos": True},
    )


def test_a_seeded_n3_request_repeats_alone_and_under_load(client: openai.OpenAI) -> None:
    first = _seeded(client)
    assert len({text for text, _ in first}) > 1  # three different samples
    assert _seeded(client) == first  # texts and logprobs, bit for bit (floats compared exactly)
    with ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(_background, client, i) for i in range(5)]
        under_load = pool.submit(_seeded, client).result()
        for f in busy:
            f.result()
    assert under_load == first


def test_greedy_logprobs_are_the_same_alone_and_batched(client: openai.OpenAI) -> None:
    def greedy() -> list[float]:
        reply = client.completions.create(
            model=MODEL, prompt="one two three four five", max_tokens=10, temperature=0.0, logprobs=3
        )
        return list(reply.choices[0].logprobs.token_logprobs)  # type: ignore[union-attr, arg-type]

    alone = greedy()
    with ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(_background, client, i) for i in range(5)]
        batched = pool.submit(greedy).result()
        for f in busy:
            f.result()
    assert batched == alone
