"""Prompt scoring over HTTP: /v1/completions with echo and max_tokens 0 (OpenAI's legacy API, and
how eval harnesses score a prompt) returns the prompt with its logprobs and no completion, equal to
what max_tokens 1 echoes and to transformers; streamed or not, alone or beside other requests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
MAX_MODEL_LEN = 128
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 22,
        # Small chunks: long prompts are prefilled over several steps, beside the decodes.
        max_num_batched_tokens=32,
    )
    with api_server(config) as started:
        yield started


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _tokens(server: ApiServer, text: str) -> list[int]:
    reply = httpx.post(f"{server.url}/tokenize", json={"prompt": text})
    return reply.json()["tokens"]  # type: ignore[no-any-return]


def _score(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 0, logprobs: int = 2) -> Any:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=logprobs, **GREEDY
    )


def _assert_close(got: list[float | None], want: list[float | None]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None and w is not None:
            assert math.isclose(g, w, abs_tol=1e-4)


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_echo_with_max_tokens_0_scores_the_prompt(
    client: openai.OpenAI, server: ApiServer, tiny_llama_dir: str
) -> None:
    from transformers import AutoModelForCausalLM

    ids = _tokens(server, PROMPT)
    result = _score(client, PROMPT)
    choice = result.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 0)
    assert result.usage.total_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens or []) == len(ids) and "".join(logprobs.tokens or []) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    offsets = logprobs.text_offset or []
    assert offsets == [sum(len(t) for t in (logprobs.tokens or [])[:i]) for i in range(len(ids))]
    for token, logprob, top in zip(
        (logprobs.tokens or [])[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert logprob is not None and top is not None and top[token] == logprob
        assert 2 <= len(top) <= 3  # the top 2, and the prompt token when it is not among them

    # The same prompt logprobs as max_tokens 1 echoes (then one generated token more).
    one = _score(client, PROMPT, max_tokens=1).choices[0].logprobs
    assert one is not None and one.token_logprobs is not None
    assert len(one.token_logprobs) == len(ids) + 1
    assert one.tokens is not None and one.tokens[: len(ids)] == logprobs.tokens
    _assert_close(logprobs.token_logprobs, one.token_logprobs[: len(ids)])

    # And transformers' log-softmax of the prompt's logits.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    _assert_close(logprobs.token_logprobs, [None] + [ref[p - 1, ids[p]].item() for p in range(1, len(ids))])


def test_a_batch_of_token_id_prompts_scores_each(client: openai.OpenAI, server: ApiServer) -> None:
    # lm-evaluation-harness sends context + continuation as token ids, several per request.
    prompts = [_tokens(server, text) for text in (PROMPT, "hello world", "x")]
    result = _score(client, prompts)  # type: ignore[arg-type]
    assert [c.index for c in result.choices] == [0, 1, 2]
    for ids, choice in zip(prompts, result.choices, strict=True):
        alone = _score(client, ids).choices[0]
        assert choice.finish_reason == "length" and choice.text == alone.text
        assert choice.logprobs is not None and alone.logprobs is not None
        assert len(choice.logprobs.token_logprobs or []) == len(ids)
        _assert_close(choice.logprobs.token_logprobs or [], alone.logprobs.token_logprobs or [])
    assert result.usage is not None and result.usage.completion_tokens == 0
    assert result.usage.prompt_tokens == sum(len(ids) for ids in prompts)


def test_echo_without_logprobs_returns_the_prompt_and_warms_the_prefix_cache(client: openai.OpenAI) -> None:
    prompt = "Roses are red, violets are blue, sugar is sweet and so are you. " * 2
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert first.choices[0].text == prompt and first.choices[0].logprobs is None
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 0
    generated = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    details = generated.usage.prompt_tokens_details if generated.usage else None
    assert details is not None and details.cached_tokens and details.cached_tokens >= 16


def test_streamed_scoring_echoes_the_prompt_then_finishes(client: openai.OpenAI) -> None:
    whole = _score(client, PROMPT).choices[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=0,
            echo=True,
            logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == PROMPT
    assert choices[-1].finish_reason == "length"
    streamed = [lp for c in choices if c.logprobs for lp in c.logprobs.token_logprobs or []]
    _assert_close(streamed, whole.logprobs.token_logprobs if whole.logprobs else [])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 0 and usage.prompt_tokens > 0


def test_scoring_beside_generation_changes_neither(client: openai.OpenAI) -> None:
    generations = ["Once upon a time", "def main():", "1 2 3 4", "The quick brown fox"]
    scorings = [PROMPT * 2, "emoji 🙂 and 中文 text", "Lorem ipsum dolor sit amet, consectetur " * 2]

    def generate(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY).choices[0].text

    def score(prompt: str) -> list[float | None]:
        logprobs = _score(client, prompt).choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        return logprobs.token_logprobs

    texts_alone = [generate(p) for p in generations]
    scores_alone = [score(p) for p in scorings]
    with ThreadPoolExecutor(max_workers=len(generations) + len(scorings)) as pool:
        texts = [pool.submit(generate, p) for p in generations]
        scores = [pool.submit(score, p) for p in scorings]
        assert [f.result() for f in texts] == texts_alone
        for future, want in zip(scores, scores_alone, strict=True):
            _assert_close(future.result(), want)


def test_a_scored_prompt_may_fill_the_context(server: ApiServer) -> None:
    ids = [(7 * i) % 400 + 20 for i in range(MAX_MODEL_LEN)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"][0]["logprobs"]["token_logprobs"]) == MAX_MODEL_LEN
    too_long = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [*ids, 20]}, timeout=60)
    assert _error(too_long, 400)["param"] == "prompt"
    generate = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert _error(generate, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "echo": False, "logprobs": 1}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": -1, "echo": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -3}),
    ],
)
def test_max_tokens_0_without_echo_is_refused(server: ApiServer, path: str, body: dict[str, Any]) -> None:
    error = _error(httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60), 400)
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert "max_tokens must be >= 1" in error["message"]


def test_min_tokens_above_max_tokens_0_is_refused(server: ApiServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 0, "echo": True, "min_tokens": 1}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert _error(reply, 400)["param"] == "min_tokens"
