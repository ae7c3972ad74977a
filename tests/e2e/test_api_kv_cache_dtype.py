"""A real server with `engine.kv_cache_dtype` = fp8: /v1/izh/stats reports the format and the tokens per
GiB of its arithmetic (2 x layers x KV heads x head_dim x 1 byte), and requests run on it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny-fp8-kv"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
        kv_cache_dtype="fp8",
    )
    with api_server(config) as started:
        yield started


def test_stats_report_the_format_and_its_tokens_per_gib(server: ApiServer) -> None:
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "one two three", "max_tokens": 4, "temperature": 0},
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    kv = httpx.get(f"{server.url}/v1/izh/stats").json()["kv_cache"]
    per_token = 2 * 2 * 2 * 16 * 1  # K and V, 2 layers, 2 KV heads, head_dim 16, one byte each
    assert kv["dtype"] == "fp8_e4m3"
    assert kv["bytes_per_token"] == per_token
    assert kv["tokens_per_gib"] == (1 << 30) // per_token
    assert kv["num_blocks"] * kv["block_size"] * per_token <= 1 << 22
