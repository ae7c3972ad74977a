"""POST /v1/embeddings over real HTTP with the official openai SDK, against a tiny random BERT (a
sentence-transformers folder) and a tiny random Llama: floats and base64, strings, lists and token
ids, usage, concurrent requests batched together giving the vectors each gives alone, the metrics,
and every refusal a 400 naming its field (dimensions, input, model for generation on an encoder)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from izh.config import EngineConfig
from izh.settings import LimitSettings
from tests.e2e.api_server import ApiServer, api_server
from tests.fixtures.bert import build_tiny_bert

MODEL = "tiny-embed"
TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "Once upon a time, in a land far away, there lived a king.",
]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_bert(tmp_path_factory.mktemp("bert"), max_seq_length=64)


@pytest.fixture(scope="module")
def server(bert_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(model=bert_dir, served_model_name=MODEL, device="cpu")
    limits = LimitSettings(max_embedding_inputs=8, max_prompt_tokens=100)
    with api_server(config, limits=limits) as started:
        yield started


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _reference(bert_dir: str, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return np.asarray(SentenceTransformer(bert_dir, device="cpu").encode(texts))


def _raw(server: ApiServer, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def _error(reply: httpx.Response) -> dict[str, object]:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


def test_sdk_floats_and_base64_match_sentence_transformers(
    client: openai.OpenAI, server: ApiServer, bert_dir: str
) -> None:
    want = _reference(bert_dir, TEXTS)
    # The SDK asks for base64 by default and decodes it.
    default = client.embeddings.create(model=MODEL, input=TEXTS)
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert default.object == "list" and default.model == MODEL
    for response in (default, floats):
        got = np.asarray([d.embedding for d in sorted(response.data, key=lambda d: d.index)])
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    reply = _raw(server, {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"})
    assert reply.status_code == 200
    data = reply.json()["data"][0]
    assert data["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(data["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, want[0], rtol=1e-4, atol=1e-5)


def test_usage_counts_the_tokens_of_every_input(client: openai.OpenAI, server: ApiServer) -> None:
    counts = [httpx.post(f"{server.url}/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS]
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert response.usage.prompt_tokens == sum(counts) == response.usage.total_tokens


def test_token_id_inputs_equal_their_text(client: openai.OpenAI, server: ApiServer) -> None:
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    several = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    # Equal up to float rounding: a batch's padding for attention may differ from one run to the next.
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        [d.embedding for d in several.data], [d.embedding for d in by_text.data], rtol=1e-5, atol=1e-6
    )


def test_concurrent_requests_give_the_vectors_each_gives_alone(client: openai.OpenAI) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} number {i}" for i in range(12)]
    alone = [
        client.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0].embedding
        for t in texts
    ]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(
                lambda t: (
                    client.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0].embedding
                ),
                texts,
            )
        )
    np.testing.assert_allclose(np.asarray(together), np.asarray(alone), rtol=1e-5, atol=1e-6)


def test_dimensions_without_matryoshka_is_a_400_naming_it(client: openai.OpenAI, server: ApiServer) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="hello", dimensions=8)
    assert refused.value.body["param"] == "dimensions"  # type: ignore[index]
    assert _error(_raw(server, {"input": "hello", "dimensions": 0}))["param"] == "dimensions"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input.1"),
        ({"input": [[1, 2], []]}, "input.1"),
        ({"input": [10**6]}, "input"),
        ({"input": [-1, 5]}, "input"),
        ({"input": 5}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"input": ["x"] * 9}, "input"),  # limits.max_embedding_inputs
        ({"input": list(range(5, 106))}, "input"),  # limits.max_prompt_tokens (100)
        ({"input": "hi", "model": "other"}, "model"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(server: ApiServer, body: dict[str, object], param: str) -> None:
    reply = _raw(server, body)
    if param == "model":
        assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
        return
    assert _error(reply)["param"] == param


def test_an_input_longer_than_the_context_is_refused(server: ApiServer) -> None:
    # sentence-transformers' max_seq_length (64) is the context: longer is refused, not truncated.
    error = _error(_raw(server, {"input": [[5, 6], list(range(5, 70))]}))
    assert error["param"] == "input.1" and error["code"] == "context_length_exceeded"


def test_the_encoder_cannot_generate(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert chat.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert completion.value.body["param"] == "model"  # type: ignore[index]


def test_metrics_count_embedding_requests_and_their_prompt_tokens(
    client: openai.OpenAI, server: ApiServer
) -> None:
    def scrape() -> tuple[float, float]:
        text = httpx.get(f"{server.url}/metrics").text
        requests = tokens = 0.0
        for line in text.splitlines():
            if line.startswith("izh:api_requests_total{") and 'endpoint="/v1/embeddings"' in line:
                requests = float(line.rsplit(" ", 1)[1])
            if line.startswith("izh:prompt_tokens_total{"):
                tokens = float(line.rsplit(" ", 1)[1])
        return requests, tokens

    before = scrape()
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    after = scrape()
    assert after[0] - before[0] == 1
    assert after[1] - before[1] == response.usage.prompt_tokens


def test_a_decoder_serves_embeddings_too(tiny_llama_dir: str, tmp_path: Path) -> None:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        device="cpu",
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
    )
    with (
        api_server(config) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="x", max_retries=0) as c,
    ):
        response = c.embeddings.create(model="tiny", input=["hello world", "a"], encoding_format="float")
        vectors = np.asarray([d.embedding for d in response.data])
        assert vectors.shape == (2, 64)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        # and it still generates
        chat = c.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
