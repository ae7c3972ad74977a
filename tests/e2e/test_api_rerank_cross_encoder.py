"""POST /v1/rerank, /rerank, /score and /v1/score over real HTTP against a tiny random cross-encoder (a
BertForSequenceClassification folder in sentence-transformers' CrossEncoder layout): scores equal
`CrossEncoder.predict` of the same folder (its sigmoid over the classifier's logit), the order, top_n,
return_documents, score's pairings and usage; the generation routes and /v1/embeddings are 400s naming
`model`; malformed pairs are 400s naming the text.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server
from tests.fixtures.cross_encoder import build_bert_cross_encoder

MODEL = "tiny-reranker"
QUERY = "where do foxes live"
DOCUMENTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "Once upon a time, in a land far away, there lived a king.",
    "foxes live in dens in the forest",
    "foxes",
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_bert_cross_encoder(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def server(reranker_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(model=reranker_dir, served_model_name=MODEL, device="cpu")
    with api_server(config) as started:
        yield started


def _predict(folder: str, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return np.asarray(CrossEncoder(folder, device="cpu").predict(pairs), dtype=np.float64)


def _post(server: ApiServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def _error(reply: httpx.Response, param: str) -> dict[str, object]:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, reply.text
    return dict(error)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_equals_cross_encoder_predict(server: ApiServer, reranker_dir: str, path: str) -> None:
    want = _predict(reranker_dir, [(QUERY, d) for d in DOCUMENTS])
    assert np.ptp(want) > 1e-3  # the random model tells the documents apart: the order is a real check
    reply = _post(server, path, {"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    results = body["results"]
    assert [r["index"] for r in results] == list(np.argsort(-want, kind="stable"))
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], np.sort(want)[::-1], rtol=1e-5, atol=1e-6
    )
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    assert all(0.0 < r["relevance_score"] < 1.0 for r in results)  # the sigmoid of the logit
    top = _post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top.json()["results"]] == [r["index"] for r in results[:2]]
    assert all(r.get("document") is None for r in top.json()["results"])
    # Usage counts each pair's tokens: [CLS] query [SEP] document [SEP].
    one = _post(server, path, {"query": QUERY, "documents": DOCUMENTS[:1]}).json()
    assert one["usage"]["total_tokens"] < body["usage"]["total_tokens"]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_pairings_equal_cross_encoder_predict(server: ApiServer, reranker_dir: str, path: str) -> None:
    one_to_many = _post(server, path, {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCUMENTS)))
    np.testing.assert_allclose(
        [d["score"] for d in one_to_many["data"]],
        _predict(reranker_dir, [(QUERY, d) for d in DOCUMENTS]),
        rtol=1e-5,
        atol=1e-6,
    )
    pairwise = _post(server, path, {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:4]}).json()
    np.testing.assert_allclose(
        [d["score"] for d in pairwise["data"]],
        _predict(reranker_dir, list(zip(DOCUMENTS[:2], DOCUMENTS[2:4], strict=True))),
        rtol=1e-5,
        atol=1e-6,
    )
    # A pair is ordered: (a, b) and (b, a) are different sequences, with different token types.
    swapped = _post(server, path, {"text_1": DOCUMENTS[2:4], "text_2": DOCUMENTS[:2]}).json()
    assert [d["score"] for d in swapped["data"]] != [d["score"] for d in pairwise["data"]]
    assert pairwise["usage"]["prompt_tokens"] == pairwise["usage"]["total_tokens"] > 0


def test_generation_and_embedding_routes_refuse_a_cross_encoder(server: ApiServer) -> None:
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert "cross-encoder" in str(_error(chat, "model")["message"])
    _error(_post(server, "/v1/completions", {"prompt": "hi"}), "model")
    embeddings = _post(server, "/v1/embeddings", {"input": "hi"})
    assert "/v1/rerank" in str(_error(embeddings, "model")["message"])
    messages = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert messages.status_code == 400 and messages.json()["type"] == "error", messages.text
    assert messages.json()["error"]["type"] == "invalid_request_error"


def test_malformed_pairs_are_400s_naming_the_text(server: ApiServer) -> None:
    _error(_post(server, "/v1/rerank", {"query": QUERY, "documents": ["a", ""]}), "documents.1")
    _error(_post(server, "/v1/rerank", {"query": "", "documents": ["a"]}), "query")
    # A pair longer than the context is refused (sentence-transformers would truncate it), naming it.
    too_long = _post(server, "/v1/rerank", {"query": QUERY, "documents": ["a", "fox " * 124]})
    assert "maximum context length" in str(_error(too_long, "documents.1")["message"])
    _error(_post(server, "/score", {"text_1": ["a", ""], "text_2": ["b", "c"]}), "text_1.1")
    _error(_post(server, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), "text_2")
