"""vLLM's allowed_token_ids and bad_words over HTTP, on /v1/chat/completions and /v1/completions,
against a real server of the default model (SmolLM2-135M-Instruct): greedy output keeps to the
allowed tokens, never writes a bad word, and bad values are OpenAI-format 400s naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from izh.config import EngineConfig
from izh.tokenizer import Tokenizer, load_tokenizer
from tests.e2e.api_server import ApiServer, api_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
ALLOWED_WORDS = [" Paris", " London", " Rome", "."]


@pytest.fixture(scope="module")
def server(smollm2_gguf: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=smollm2_gguf,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=512,
        kv_cache_memory_bytes=1 << 26,
    )
    with api_server(config) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: str) -> Tokenizer:
    return load_tokenizer(smollm2_gguf)


def _allowed_ids(tokenizer: Tokenizer) -> list[int]:
    """One token per allowed word (each is a single SmolLM2 token), plus the end of the turn."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in ALLOWED_WORDS]
    assert all(len(word_ids) == 1 for word_ids in ids)
    return [word_ids[0] for word_ids in ids] + sorted(tokenizer.eos_token_ids)


def _only_allowed_words(text: str) -> bool:
    return re.fullmatch("(?:" + "|".join(re.escape(word) for word in ALLOWED_WORDS) + ")*", text) is not None


def test_chat_allowed_token_ids(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0.0)
    assert not _only_allowed_words(free.choices[0].message.content or "")
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"allowed_token_ids": _allowed_ids(tokenizer)},
    )
    choice = reply.choices[0]
    text = choice.message.content or ""
    assert text and _only_allowed_words(text), text
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.content
    end_of_turn = {
        tokenizer.decode([token_id], skip_special_tokens=False) for token_id in tokenizer.eos_token_ids
    }
    for entry in choice.logprobs.content:
        assert entry.token in {*ALLOWED_WORDS, *end_of_turn}
    # As vLLM's: the logprobs are the model's own, so the top ones may be tokens it was not allowed.
    tops = {top.token for entry in choice.logprobs.content for top in entry.top_logprobs}
    assert tops - set(ALLOWED_WORDS)


def test_completions_allowed_token_ids_sampled(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"allowed_token_ids": _allowed_ids(tokenizer)},
    )
    for choice in reply.choices:
        assert _only_allowed_words(choice.text), choice.text


def test_chat_bad_words(client: openai.OpenAI) -> None:
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0.0)
    assert "Paris" in (free.choices[0].message.content or "")
    for stream in (False, True):
        kwargs: dict[str, Any] = {"extra_body": {"bad_words": ["Paris", "capital"]}}
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=QUESTION, max_tokens=32, temperature=0.0, stream=True, **kwargs
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=32, temperature=0.0, **kwargs
            )
            text = reply.choices[0].message.content or ""
        assert text and "Paris" not in text and " capital" not in text and not text.startswith("capital")


def test_completions_bad_words(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0)
    assert free.choices[0].text.startswith(" Paris")
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"bad_words": ["Paris"]}
    )
    assert reply.choices[0].text and "Paris" not in reply.choices[0].text


# ---- bad input -------------------------------------------------------------------------------------


def _error(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"allowed_token_ids": [1, 49152]}, "allowed_token_ids"),  # SmolLM2 has 49152 ids
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": ["Paris"]}, "allowed_token_ids.0"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"bad_words": "Paris"}, "bad_words"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["Paris", 3]}, "bad_words.1"),
        ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_values_are_400s_naming_the_field(
    server: ApiServer, route: str, stream: bool, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "stream": stream, **fields}
    if route == "/v1/chat/completions":
        body["messages"] = QUESTION
    else:
        body["prompt"] = "Hello"
    error = _error(httpx.post(f"{server.url}{route}", json=body, timeout=60))
    assert error["param"] == param
