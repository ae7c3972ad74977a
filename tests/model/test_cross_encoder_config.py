"""Cross-encoder configs and files: the label count (transformers' rule; more than one label refused at
load), XLM-RoBERTa's position offset, the activation sentence-transformers applies (read from each
place its versions write it), and pair tokenization equal to transformers' tokenizer(a, b)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from izh.errors import ModelLoadError, UnsupportedModel
from izh.model.config import ModelConfig
from izh.model.cross_encoder import resolve_score_activation
from izh.tokenizer import load_tokenizer
from tests.fixtures.cross_encoder import (
    IDENTITY,
    SIGMOID,
    build_bert_cross_encoder,
    build_xlm_roberta_cross_encoder,
)

_BERT: dict[str, Any] = {
    "architectures": ["BertForSequenceClassification"],
    "model_type": "bert",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
PAIRS = [
    ("where do foxes live", "foxes live in dens in the forest"),
    ("hello", "Once upon a time, in a land far away, there lived a king."),
]


def test_a_single_label_classifier_is_a_cross_encoder() -> None:
    config = ModelConfig.from_hf_config({**_BERT, "id2label": {"0": "LABEL_0"}})
    assert (config.architecture, config.num_labels, config.is_encoder) == ("bert_classifier", 1, True)
    assert config.position_offset == 0 and config.max_position_embeddings == 512
    assert ModelConfig.from_hf_config({**_BERT, "num_labels": 1}).num_labels == 1


@pytest.mark.parametrize(
    ("fields", "labels"),
    [({"id2label": {"0": "a", "1": "b", "2": "c"}}, 3), ({}, 2), ({"num_labels": 2}, 2)],
)
def test_multi_label_classifiers_are_refused_at_load(fields: dict[str, Any], labels: int) -> None:
    # transformers' rule: id2label's size, else num_labels, else 2.
    with pytest.raises(UnsupportedModel, match=f"{labels} labels.*single-label"):
        ModelConfig.from_hf_config({**_BERT, **fields})


def test_xlm_roberta_positions_start_past_the_padding_index() -> None:
    config = ModelConfig.from_hf_config(
        {
            **_BERT,
            "architectures": ["XLMRobertaForSequenceClassification"],
            "model_type": "xlm-roberta",
            "max_position_embeddings": 514,
            "pad_token_id": 1,
            "type_vocab_size": 1,
            "id2label": {"0": "LABEL_0"},
        }
    )
    assert config.architecture == "xlm_roberta_classifier"
    assert (config.position_offset, config.max_position_embeddings, config.type_vocab_size) == (2, 512, 1)


def _folder(tmp_path: Path, config: dict[str, Any], **files: Any) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name, value in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(value))
    return str(tmp_path)


def test_the_activation_is_read_where_sentence_transformers_writes_it(tmp_path: Path) -> None:
    assert resolve_score_activation(_folder(tmp_path / "none", {}), 1) == "sigmoid"
    v4 = {"sentence_transformers": {"activation_fn": IDENTITY, "version": "4.1.0"}}
    assert resolve_score_activation(_folder(tmp_path / "v4", v4), 1) == "identity"
    legacy = {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}
    assert resolve_score_activation(_folder(tmp_path / "legacy", legacy), 1) == "tanh"
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.Transformer"}]
    v6 = _folder(
        tmp_path / "v6", v4, modules=modules, config_sentence_transformers={"activation_fn": SIGMOID}
    )
    assert resolve_score_activation(v6, 1) == "sigmoid"  # config_sentence_transformers.json wins
    # A non-torch path runs in sentence-transformers only with trust_remote_code: its default applies.
    custom = {"sentence_transformers": {"activation_fn": "my_package.Scale"}}
    assert resolve_score_activation(_folder(tmp_path / "custom", custom), 1) == "sigmoid"


def test_an_activation_or_module_izh_does_not_run_is_refused(tmp_path: Path) -> None:
    softmax = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Softmax"}}
    with pytest.raises(ModelLoadError, match="Softmax"):
        resolve_score_activation(_folder(tmp_path / "softmax", softmax), 1)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.base.modules.Dense"},
    ]
    with pytest.raises(ModelLoadError, match="Dense"):
        resolve_score_activation(_folder(tmp_path / "dense", {}, modules=modules), 1)


@pytest.mark.parametrize("kind", ["bert", "xlm_roberta"])
def test_pairs_tokenize_as_transformers_tokenizes_them(tmp_path: Path, kind: str) -> None:
    from transformers import AutoTokenizer

    build = build_bert_cross_encoder if kind == "bert" else build_xlm_roberta_cross_encoder
    folder = build(tmp_path)
    ours = load_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    for first, second in PAIRS:
        ids, segment_start = ours.encode_pair(first, second)
        want = theirs(first, second)
        assert ids == want["input_ids"]
        if kind == "bert":
            types = want["token_type_ids"]
            assert segment_start == types.index(1) and set(types[segment_start:]) == {1}
        else:
            assert "token_type_ids" not in want  # RoBERTa's model reads type 0 throughout
