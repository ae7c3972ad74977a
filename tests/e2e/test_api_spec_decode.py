"""Speculative decoding through `izh serve --speculative-config` with the OpenAI SDK: streamed text,
logprobs, a JSON schema and a tool call, against the same server without drafts; the spec_decode
metrics and the per-request opt-out (docs/operations.md, "Speculative decoding")."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.real_server import API_KEY, RealServer, serve_default_model

pytestmark = pytest.mark.slow

FUNCTION = """def mean(values):
    if not values:
        raise ValueError("empty")
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""
KERNELS = ("--cpu-kernels", "avx2")
"""Both servers on the float32 record path, whose rows do not depend on their batch. (On the bfloat16
path of an AVX512-BF16 CPU the tokens were the same too, but logprobs moved by more than 1e-3: its LM
head's rows are not batch-invariant yet.)"""
EDIT = [
    {"role": "user", "content": f"```python\n{FUNCTION}```\nRewrite this function, renaming total to acc."}
]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec_server(
    smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RealServer]:
    """n-gram drafts, or a tiny random draft model of SmolLM2's tokenizer (its drafts mostly wrong)."""
    config: dict[str, object] = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    if request.param == "draft_model":
        from izh.model.loader import load_model_config
        from tests.fixtures.draft import build_tiny_draft

        vocab_size = load_model_config(smollm2_gguf).vocab_size
        draft = build_tiny_draft(tmp_path_factory.mktemp("draft"), smollm2_gguf, vocab_size)
        config = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    args = ("--speculative-config", json.dumps(config), *KERNELS)
    yield from serve_default_model(smollm2_gguf, tmp_path_factory, args)


@pytest.fixture(scope="module")
def base_server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from serve_default_model(smollm2_gguf, tmp_path_factory, KERNELS)


def _client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def _counter(server: RealServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return sum(float(m[1]) for m in re.finditer(rf"^izh:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def _stream(server: RealServer, **extra: object) -> tuple[str, list[tuple[str, float]], int]:
    with _client(server) as client:
        stream = client.chat.completions.create(
            model=server.model, messages=EDIT, max_tokens=120, temperature=0, stream=True, logprobs=True,
            top_logprobs=2, stream_options={"include_usage": True}, **extra,
        )  # fmt: skip
        text, logprobs, usage = [], [], 0
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                    logprobs.append((entry.token, entry.logprob))
                    assert len(entry.top_logprobs) == 2
    return "".join(text), logprobs, usage


def test_streamed_text_and_logprobs_match_the_server_without_drafts(
    spec_server: RealServer, base_server: RealServer, request: pytest.FixtureRequest
) -> None:
    accepted_before = _counter(spec_server, "spec_decode_num_accepted_tokens")
    text, logprobs, usage = _stream(spec_server)
    want_text, want_logprobs, want_usage = _stream(base_server)
    assert (text, usage) == (want_text, want_usage)
    assert [t for t, _ in logprobs] == [t for t, _ in want_logprobs]
    assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(logprobs, want_logprobs, strict=True))
    assert len(logprobs) == usage
    assert _counter(spec_server, "spec_decode_num_drafts") > 0
    if request.node.callspec.params["spec_server"] == "ngram":  # the random draft model is rarely right
        assert _counter(spec_server, "spec_decode_num_accepted_tokens") > accepted_before


def test_opt_out_drafts_nothing(spec_server: RealServer) -> None:
    before = _counter(spec_server, "spec_decode_num_draft_tokens")
    _stream(spec_server, extra_body={"speculative_decoding": False})
    assert _counter(spec_server, "spec_decode_num_draft_tokens") == before
    with _client(spec_server) as client, pytest.raises(openai.BadRequestError, match="speculative_decoding"):
        client.chat.completions.create(
            model=spec_server.model, messages=EDIT, max_tokens=4, extra_body={"speculative_decoding": "maybe"}
        )


def test_json_schema_and_tool_call(spec_server: RealServer, base_server: RealServer) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]}},
    }  # fmt: skip
    answers = []
    for server in (spec_server, base_server):
        with _client(server) as client:
            structured = client.chat.completions.create(
                model=server.model, max_tokens=60, temperature=0,
                messages=[{"role": "user", "content": "Jason is 25 years old. Give his name and age."}],
                response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema}},
            )  # fmt: skip
            called = client.chat.completions.create(
                model=server.model, max_tokens=60, temperature=0, tools=[tool], tool_choice="required",
                messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            )  # fmt: skip
        user = json.loads(structured.choices[0].message.content or "")
        assert set(user) == {"name", "age"} and isinstance(user["age"], int)
        (call,) = called.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        answers.append((structured.choices[0].message.content, call.function.arguments))
    assert answers[0] == answers[1]
