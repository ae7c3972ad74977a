"""Tokenizers loaded from HF folders: BOS/EOS rules, eos ids, special tokens and templates,
compared with transformers loading the same folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizer_helpers import (
    CHATML_TEMPLATE,
    CORPUS,
    train_byte_level_bpe,
    train_sentencepiece_like,
    write_hf_folder,
)

from izh.errors import InvalidRequest, ModelLoadError
from izh.tokenizer import load_tokenizer
from izh.tokenizer.tokenizer import bytes_to_unicode

transformers = pytest.importorskip("transformers")


def hf_tokenizer(folder: Path) -> Any:
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def byte_level() -> Any:
    return train_byte_level_bpe("qwen2")


def with_llama3_post_processor(tokenizer: Any) -> Any:
    """The tokenizer with Llama 3's tokenizer.json post-processor (BOS = id 0 before each text)."""
    from tokenizers import Tokenizer, processors

    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        pair="<|endoftext|> $A <|endoftext|> $B:1",
        special_tokens=[("<|endoftext|>", 0)],
    )
    return copy


@pytest.mark.parametrize(
    ("post_processor_bos", "config"),
    [
        (False, {}),
        (True, {}),
        (False, {"add_bos_token": True}),
        (True, {"add_bos_token": False}),
        (False, {"add_bos_token": True, "add_eos_token": True}),
    ],
)
def test_bos_eos_rules_match_transformers(
    tmp_path: Path, byte_level: Any, post_processor_bos: bool, config: dict[str, Any]
) -> None:
    backend = with_llama3_post_processor(byte_level) if post_processor_bos else byte_level
    folder = write_hf_folder(
        tmp_path,
        backend,
        tokenizer_config={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", **config},
    )
    ours = load_tokenizer(str(folder))
    reference = hf_tokenizer(folder)
    for text in CORPUS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        ids = reference.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(reference)
    # all_special_ids: every id skip_special_tokens drops (transformers' list names fewer).
    special = {i for i, token in reference.added_tokens_decoder.items() if token.special}
    assert ours.all_special_ids == frozenset(special) >= frozenset(reference.all_special_ids)


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path: Path, byte_level: Any) -> None:
    folder = write_hf_folder(
        tmp_path / "list",
        byte_level,
        tokenizer_config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        generation_config={"eos_token_id": [0, 1], "temperature": 0.6},
    )
    ours = load_tokenizer(str(folder))
    assert ours.eos_token_id == 2
    assert ours.eos_token_ids == frozenset({0, 1, 2})
    assert ours.pad_token_id == 0
    assert ours.bos_token_id is None
    assert ours.generation_config == {"eos_token_id": [0, 1], "temperature": 0.6}
    single = load_tokenizer(
        str(write_hf_folder(tmp_path / "int", byte_level, generation_config={"eos_token_id": 1}))
    )
    assert single.eos_token_id is None
    assert single.eos_token_ids == frozenset({1})
    assert single.generation_config == {"eos_token_id": 1}
    bare = load_tokenizer(str(write_hf_folder(tmp_path / "bare", byte_level)))
    assert bare.eos_token_ids == frozenset() and bare.generation_config == {}


def test_special_tokens_as_added_token_dicts_and_new_tokens(tmp_path: Path, byte_level: Any) -> None:
    # tokenizer_config may spell tokens as serialized AddedTokens, and name tokens the vocab lacks.
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
        "unk_token": None,
    }
    folder = write_hf_folder(tmp_path, byte_level, tokenizer_config=config)
    ours = load_tokenizer(str(folder))
    reference = hf_tokenizer(folder)
    assert ours.bos_token == "<s>" and ours.bos_token_id == reference.bos_token_id
    assert ours.vocab_size == len(reference)
    assert ours.encode("a<s>b", add_special_tokens=False) == reference.encode(
        "a<s>b", add_special_tokens=False
    )
    assert ours.decode(ours.encode("a<s>b"), skip_special_tokens=True) == "ab"


def test_chat_template_sources_and_names(tmp_path: Path, byte_level: Any) -> None:
    config = {
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "config:{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
        ],
    }
    folder = write_hf_folder(tmp_path, byte_level, tokenizer_config=config)
    ours = load_tokenizer(str(folder))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "config:hi"
    assert ours.apply_chat_template(messages, tools=[{"type": "function"}]) == "tools:1"
    assert ours.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "tools:0"
    assert ours.apply_chat_template(messages, chat_template="inline:{{ eos_token }}") == "inline:<|im_end|>"
    # chat_template.jinja wins over tokenizer_config, as in transformers.
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    assert load_tokenizer(str(folder)).chat_template == CHATML_TEMPLATE


def test_missing_chat_template_is_an_invalid_request(tmp_path: Path, byte_level: Any) -> None:
    ours = load_tokenizer(str(write_hf_folder(tmp_path, byte_level)))
    assert ours.chat_template is None
    with pytest.raises(InvalidRequest, match="no chat template") as excinfo:
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert excinfo.value.param == "chat_template"


def test_missing_tokenizer_json_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path))


def test_token_bytes_byte_level(tmp_path: Path, byte_level: Any) -> None:
    ours = load_tokenizer(str(write_hf_folder(tmp_path, byte_level)))
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    for token, token_id in byte_level.get_vocab().items():
        expected = token.encode() if token.startswith("<|") else bytes(byte_of[c] for c in token)
        assert ours.token_bytes(token_id) == expected, token
    # Every token's bytes decode to what decode() gives for it alone.
    for token_id in range(ours.vocab_size):
        assert ours.token_bytes(token_id).decode("utf-8", "replace") == ours.decode([token_id])
    assert ours.token_bytes(10**6) == b""


def test_token_bytes_sentencepiece_like(tmp_path: Path) -> None:
    backend = train_sentencepiece_like()
    ours = load_tokenizer(str(write_hf_folder(tmp_path, backend, tokenizer_config={"bos_token": "<s>"})))
    assert not ours.is_byte_level
    assert ours.token_bytes(backend.token_to_id("<0x41>")) == b"A"
    assert ours.token_bytes(backend.token_to_id("<0xF0>")) == b"\xf0"
    assert ours.token_bytes(backend.token_to_id("▁don")) == b" don"
    assert ours.token_bytes(backend.token_to_id("<s>")) == b"<s>"
    text = "Hello world 😀"
    ids = ours.encode(text, add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids).decode() == " " + text


def test_tokenizer_json_padding_and_truncation_are_ignored(tmp_path: Path, byte_level: Any) -> None:
    folder = write_hf_folder(tmp_path, byte_level)
    document = json.loads((folder / "tokenizer.json").read_text())
    document["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
    document["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<|endoftext|>",
    }
    (folder / "tokenizer.json").write_text(json.dumps(document))
    ours = load_tokenizer(str(folder))
    assert ours.encode("hello world, a longer text") == byte_level.encode("hello world, a longer text").ids
