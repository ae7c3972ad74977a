"""POST /v1/rerank, /rerank, /score and /v1/score over real HTTP against a tiny random BERT (a
sentence-transformers folder): scores equal sentence-transformers' cosine of its own embeddings
(`util.cos_sim` of `encode`), the rerank order, top_n and return_documents, score's 1:N and N:N
pairings and usage; a generative model and every malformed body are 400s naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from izh.config import EngineConfig
from izh.settings import LimitSettings
from tests.e2e.api_server import ApiServer, api_server
from tests.fixtures.bert import build_tiny_bert

MODEL = "tiny-embed"
QUERY = "where do foxes live"
DOCUMENTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "Once upon a time, in a land far away, there lived a king.",
    "foxes live in dens in the forest",
]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_bert(tmp_path_factory.mktemp("bert"), max_seq_length=64)


@pytest.fixture(scope="module")
def server(bert_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(model=bert_dir, served_model_name=MODEL, device="cpu")
    with api_server(config, limits=LimitSettings(max_embedding_inputs=8)) as started:
        yield started


def _cos_sim(bert_dir: str, left: list[str], right: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer, util

    model = SentenceTransformer(bert_dir, device="cpu")
    return util.cos_sim(model.encode(left), model.encode(right)).numpy()


def _post(server: ApiServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def _error(reply: httpx.Response, param: str) -> None:
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_scores_and_order_match_sentence_transformers(
    server: ApiServer, bert_dir: str, path: str
) -> None:
    want = _cos_sim(bert_dir, [QUERY], DOCUMENTS)[0]
    reply = _post(server, path, {"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == MODEL and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert [r["index"] for r in results] == list(np.argsort(-want))
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], np.sort(want)[::-1], rtol=1e-4, atol=1e-5
    )
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    top = _post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top.json()["results"]] == [r["index"] for r in results[:2]]
    assert all("document" not in r or r["document"] is None for r in top.json()["results"])


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_pairings_match_sentence_transformers(server: ApiServer, bert_dir: str, path: str) -> None:
    one_to_many = _post(server, path, {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    want = _cos_sim(bert_dir, [QUERY], DOCUMENTS)[0]
    assert one_to_many["object"] == "list" and [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], want, rtol=1e-4, atol=1e-5)
    pairwise = _post(server, path, {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]}).json()
    pairs = _cos_sim(bert_dir, DOCUMENTS[:2], DOCUMENTS[2:])
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], np.diag(pairs), rtol=1e-4, atol=1e-5)
    single = _post(server, path, {"text_1": QUERY, "text_2": QUERY}).json()
    assert single["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert single["usage"]["prompt_tokens"] == single["usage"]["total_tokens"] > 0


def test_malformed_bodies_are_400s_naming_the_field(server: ApiServer) -> None:
    _error(_post(server, "/v1/rerank", {"query": QUERY, "documents": []}), "documents")
    _error(_post(server, "/v1/rerank", {"query": QUERY, "documents": ["a", ""]}), "documents.1")
    _error(_post(server, "/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}), "top_n")
    _error(_post(server, "/v1/rerank", {"query": QUERY, "documents": ["a"] * 9}), "documents")
    _error(
        _post(server, "/v1/rerank", {"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 4}),
        "truncate_prompt_tokens",
    )
    _error(_post(server, "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}), "text_2")
    _error(_post(server, "/score", {"text_1": "a", "text_2": ["a", "x " * 200]}), "text_2.1")
    assert _post(server, "/score", {"text_1": "a", "text_2": "b", "model": "other"}).status_code == 404


def test_a_generative_model_cannot_score(tiny_llama_dir: str) -> None:
    config = EngineConfig(model=tiny_llama_dir, served_model_name="tiny", device="cpu", max_model_len=256)
    with api_server(config) as started:
        for path, body in (
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
            ("/score", {"text_1": "a", "text_2": "b"}),
        ):
            reply = httpx.post(f"{started.url}{path}", json={"model": "tiny", **body}, timeout=60)
            _error(reply, "model")
            assert "embedding model" in reply.json()["error"]["message"]
