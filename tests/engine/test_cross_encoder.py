"""Offline `LLM.score` (vLLM's): a cross-encoder's scores equal sentence-transformers'
`CrossEncoder.predict` (BERT with its sigmoid, XLM-RoBERTa with an identity activation: raw logits, its
offset positions and one token type), pairs batched in one step alike scored one at a time; an embedding
model's score is the cosine of its embeddings; a cross-encoder embeds nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from izh import LLM
from izh.errors import InvalidRequest
from tests.fixtures.bert import build_tiny_bert
from tests.fixtures.cross_encoder import IDENTITY, build_bert_cross_encoder, build_xlm_roberta_cross_encoder

QUERY = "where do foxes live"
DOCUMENTS = [
    "foxes live in dens in the forest",
    "hello world",
    "Once upon a time, in a land far away, there lived a king.",
]


def _predict(folder: str, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    return np.asarray(CrossEncoder(folder, device="cpu").predict(pairs), dtype=np.float64)


@pytest.mark.parametrize("kind", ["bert", "xlm_roberta"])
def test_llm_score_equals_cross_encoder_predict(tmp_path: Path, kind: str) -> None:
    if kind == "bert":
        folder = build_bert_cross_encoder(tmp_path)
    else:
        folder = build_xlm_roberta_cross_encoder(tmp_path, activation=IDENTITY)
    llm = LLM(folder, device="cpu")
    want = _predict(folder, [(QUERY, d) for d in DOCUMENTS])
    got = [out.score for out in llm.score(QUERY, DOCUMENTS)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if kind == "xlm_roberta":
        assert min(got) < 0 or max(got) > 1  # identity: the raw logits, not squashed
    one_by_one = [llm.score(QUERY, d)[0].score for d in DOCUMENTS]
    np.testing.assert_allclose(one_by_one, got, rtol=1e-6, atol=1e-7)
    pairwise = llm.score(DOCUMENTS[:2], DOCUMENTS[1:][::-1])
    np.testing.assert_allclose(
        [out.score for out in pairwise],
        _predict(folder, list(zip(DOCUMENTS[:2], DOCUMENTS[1:][::-1], strict=True))),
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(InvalidRequest) as refused:
        llm.embed("a text")
    assert refused.value.param == "model"
    with pytest.raises(InvalidRequest):
        llm.score(DOCUMENTS[:2], DOCUMENTS)


def test_llm_score_of_an_embedding_model_is_the_cosine(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer, util

    folder = build_tiny_bert(tmp_path)
    got = [out.score for out in LLM(folder, device="cpu").score(QUERY, DOCUMENTS)]
    model = SentenceTransformer(folder, device="cpu")
    want = util.cos_sim(model.encode([QUERY]), model.encode(DOCUMENTS)).numpy()[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_folder_saved_by_sentence_transformers_6_scores_with_its_activation(tmp_path: Path) -> None:
    """CrossEncoder.save (sentence-transformers 5+) writes modules.json and the activation into
    config_sentence_transformers.json, which wins over config.json's (here: identity over sigmoid)."""
    import torch
    from sentence_transformers import CrossEncoder

    saved = tmp_path / "saved"
    CrossEncoder(
        build_bert_cross_encoder(tmp_path / "source"), device="cpu", activation_fn=torch.nn.Identity()
    ).save(str(saved))
    want = _predict(str(saved), [(QUERY, d) for d in DOCUMENTS])
    got = [out.score for out in LLM(str(saved), device="cpu").score(QUERY, DOCUMENTS)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert min(got) < 0 or max(got) > 1  # raw logits: the identity applied, not config.json's sigmoid
