"""Constrained JSON terminates on the real default model: asked for pi as JSON, SmolLM2-135M writes
`3.1415926535987392653616336323128128128...` until max_tokens under llguidance's own number grammar.
Through a real server, the bounded number ends and the reply finishes with "stop"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from izh.config import EngineConfig
from izh.guided_spec import MAX_SIGNIFICANT_DIGITS
from tests.e2e.api_server import api_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_TOKENS = 96


def _number_schema(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "number"}},
        "required": [name],
        "additionalProperties": False,
    }


@pytest.fixture(scope="module")
def client(smollm2_gguf: str) -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        model=smollm2_gguf,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=512,
        kv_cache_memory_bytes=1 << 26,
    )
    with (
        api_server(config) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="x", max_retries=0, timeout=600) as c,
    ):
        yield c


def _significant_digits(number: float) -> int:
    return len(repr(number).split("e")[0].replace("-", "").replace(".", "").strip("0"))


def test_a_number_property_ends_with_stop(client: openai.OpenAI) -> None:
    schema = _number_schema("pi")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the value of pi? Answer as JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "pi", "schema": schema}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    pi = json.loads(choice.message.content or "")["pi"]
    assert abs(pi - 3.14159) < 1e-3
    assert _significant_digits(pi) <= MAX_SIGNIFICANT_DIGITS
    assert reply.usage is not None and reply.usage.completion_tokens < MAX_TOKENS


def test_structured_outputs_number_streamed_ends_with_stop(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 1 divided by 3? Answer as JSON."}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"structured_outputs": {"json": _number_schema("value")}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"], text
    assert isinstance(json.loads(text)["value"], float | int)
