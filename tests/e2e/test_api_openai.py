"""The official openai client against a real izh server (tiny random Llama, real engine core):
completions and chat, streamed and not, n and batches, logprobs, usage, tokenize, models, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
MAX_MODEL_LEN = 128
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
# Long enough to fill whole KV blocks (16 tokens), so a repeat hits the prefix cache.
LONG_MESSAGE = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 22,
    )
    with api_server(config) as started:
        yield started


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _stream_text(chunks: list[Any], index: int = 0) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index)


# --- models ---------------------------------------------------------------------------------------


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "izh" and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found"


# --- completions ----------------------------------------------------------------------------------


def test_completion_greedy_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, **GREEDY)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert _stream_text(chunks) == choice.text
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_on_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            **GREEDY,
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert (
        len(counts) == len([c for c in chunks if c.choices]) and counts == sorted(counts) and counts[-1] == 4
    )
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    )


def test_n_and_batch_prompts_index_choices(client: openai.OpenAI) -> None:
    prompts = ["Hello there", "The quick brown fox"]
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, **GREEDY).choices[0].text
        for p in prompts
    ]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=4, **GREEDY)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    for choice in batch.choices:
        # index = prompt_index * n + sample_index; greedy samples of one prompt agree.
        assert choice.text == singles[choice.index // 3]
    assert batch.usage is not None and batch.usage.completion_tokens == 6 * 4
    streamed = list(
        client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=4, stream=True, **GREEDY)
    )
    for index in range(6):
        assert _stream_text(streamed, index) == singles[index // 3]


def test_token_id_prompts_and_echo(client: openai.OpenAI, server: ApiServer) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=tokens, max_tokens=3, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True, **GREEDY)
    assert echoed.choices[0].text == "Hello there" + by_text.choices[0].text


def test_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, logprobs=2, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == len(logprobs.top_logprobs or []) == 4
    assert "".join(logprobs.tokens) == result.choices[0].text
    offsets = logprobs.text_offset or []
    assert offsets == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True
    ):
        assert logprob is not None and logprob <= 0 and top is not None
        assert token in top and 2 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert logprob == max(top.values())

    echoed = (
        client.completions.create(
            model=MODEL, prompt="Hello there", max_tokens=2, logprobs=1, echo=True, **GREEDY
        )
        .choices[0]
        .logprobs
    )
    assert echoed is not None and echoed.token_logprobs is not None and echoed.top_logprobs is not None
    num_prompt = len(echoed.token_logprobs) - 2
    assert num_prompt >= 2
    assert echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None
    assert all(lp is not None for lp in echoed.token_logprobs[1:])
    assert "".join(echoed.tokens or []).startswith("Hello there")


# --- chat -------------------------------------------------------------------------------------------


def test_chat_greedy_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, **GREEDY)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and whole.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert whole.usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_usage_reports_cached_tokens(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": LONG_MESSAGE}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    usage = chunks[-1].usage
    assert first.usage is not None and usage is not None
    assert usage.prompt_tokens == first.usage.prompt_tokens > 32
    assert usage.prompt_tokens_details is not None
    # The repeat finds the first request's full blocks in the prefix cache.
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0 and cached % 16 == 0 and cached < usage.prompt_tokens


def test_chat_n_indexes_choices(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Count."}]
    result = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=3, **GREEDY)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) == 1
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, n=3, max_tokens=3, stream=True, **GREEDY
        )
    )
    for index in range(3):
        text = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index
        )
        assert text == result.choices[0].message.content


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 4
    for entry in logprobs.content:
        assert entry.logprob <= 0 and entry.bytes is not None
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
    # Token strings show a partial UTF-8 sequence as "bytes:\\x..": the raw bytes are what add up.
    raw = b"".join(bytes(e.bytes or []) for e in logprobs.content)
    assert raw.decode("utf-8", errors="replace") == result.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **GREEDY,
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in logprobs.content]


def test_chat_continue_final_message_and_echo(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    result = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0.0,
        extra_body={
            "ignore_eos": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
        },
    )
    assert (result.choices[0].message.content or "").startswith("Well,")


# --- tokenize, metrics, stats ---------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server: ApiServer, client: openai.OpenAI) -> None:
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}).json() == {
        "prompt": "Hello there"
    }
    messages = [{"role": "user", "content": "Hi"}]
    chat_tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **GREEDY).usage  # type: ignore[arg-type]
    assert usage is not None and chat_tokens["count"] == usage.prompt_tokens


def test_metrics_and_stats_after_requests(server: ApiServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    labels = f'engine="0",model_name="{MODEL}"'
    prompt_tokens = next(
        line for line in text.splitlines() if line.startswith(f"izh:prompt_tokens_total{{{labels}}}")
    )
    assert float(prompt_tokens.split()[-1]) > 0
    assert f'izh:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}}' in text
    stats = httpx.get(f"{server.url}/v1/izh/stats").json()
    assert stats["model"] == MODEL and "num_running" in stats["scheduler"]
    assert isinstance(stats["kv_block_states"], list) and stats["kv_block_states"]


def test_health_ready_version(server: ApiServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    reply = httpx.get(f"{server.url}/health", headers={"X-Request-Id": "trace-42"})
    assert reply.headers["x-request-id"] == "trace-42"


def test_64_concurrent_streams_have_distinct_consistent_ids(server: ApiServer, client: openai.OpenAI) -> None:
    import asyncio

    prompts = [f"stream number {i}: " + "abc " * (i % 7) for i in range(64)]
    expected = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY).choices[0].text
        for p in prompts[:4]
    ]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[set[str], str]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, stream=True, **GREEDY
        )
        ids, text = set(), []
        async for chunk in stream:
            ids.add(chunk.id)
            text.extend(c.text for c in chunk.choices)
        return ids, "".join(text)

    async def run() -> list[tuple[set[str], str]]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run())
    assert all(len(ids) == 1 for ids, _ in results)  # one id per stream, on every chunk
    assert len({next(iter(ids)) for ids, _ in results}) == 64  # distinct across streams
    assert [text for _, text in results[:4]] == expected  # batched with 63 others: the same greedy text
