"""Tokenizers built from GGUF metadata encode and decode exactly like transformers' and like the
models' own tokenizer.json layouts."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizer_helpers import (
    CHATML_TEMPLATE,
    CORPUS,
    SMOLLM2_GGUF,
    train_byte_level_bpe,
    vocab_and_merges,
    write_tokenizer_gguf,
)
from tokenizers import Tokenizer as HfBackend
from tokenizers import pre_tokenizers

from izh.errors import ModelLoadError
from izh.tokenizer import Tokenizer, load_tokenizer
from izh.tokenizer.gguf_metadata import read_gguf_metadata
from izh.tokenizer.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf_metadata

transformers = pytest.importorskip("transformers")


def hf_gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer built from the same GGUF file (the reference). The tokenizer class
    directly: AutoTokenizer would also parse the whole file for the model config (seconds)."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_encoding(ours: Tokenizer, reference: Any, texts: list[str]) -> None:
    for text in texts:
        expected = reference.encode(text, add_special_tokens=True)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.decode(expected, clean_up_tokenization_spaces=False), text


# ---- the real SmolLM2 GGUF ----------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(SMOLLM2_GGUF is None, reason="SmolLM2 GGUF not installed")


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    assert SMOLLM2_GGUF is not None
    return load_tokenizer(str(SMOLLM2_GGUF))


@pytest.fixture(scope="module")
def smollm2_hf() -> Any:
    assert SMOLLM2_GGUF is not None
    return hf_gguf_tokenizer(SMOLLM2_GGUF)


@needs_smollm2
def test_smollm2_matches_transformers_gguf_tokenizer(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    assert_same_encoding(smollm2, smollm2_hf, CORPUS)
    assert smollm2.vocab_size == len(smollm2_hf) == 49152


@needs_smollm2
def test_smollm2_matches_its_tokenizer_json_layout(smollm2: Tokenizer, smollm2_hf: Any) -> None:
    # SmolLM2's own tokenizer.json: the same vocabulary, each digit split off, then GPT-2's regex.
    reference = HfBackend.from_str(smollm2_hf.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in [*CORPUS, "x 12 y1 2023-01-02 ½ ² ٣٤ 一二三"]:
        assert smollm2.encode(text) == reference.encode(text).ids, text
        assert smollm2.decode(smollm2.encode(text)) == text, text


@needs_smollm2
def test_smollm2_special_tokens_and_template(smollm2: Tokenizer) -> None:
    assert smollm2.bos_token_id == 1
    assert smollm2.eos_token_id == 2
    assert smollm2.eos_token_ids == frozenset({2})
    assert smollm2.pad_token_id == 2
    assert smollm2.all_special_ids == frozenset(range(17))
    assert smollm2.generation_config == {}
    # add_bos_token is false in this file: no BOS even with special tokens on.
    assert smollm2.encode("hi")[0] != 1
    assert smollm2.encode("<|im_start|>user") == [1, 4093]
    assert smollm2.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert smollm2.convert_ids_to_tokens([1, 4093, 216]) == ["<|im_start|>", "user", "Ġ"]
    assert smollm2.token_bytes(216) == b" "
    assert smollm2.token_bytes(2) == b"<|im_end|>"


# ---- tiny GGUFs, one per pre-tokenizer ----------------------------------------------------------


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_tiny_gguf_matches_transformers(tmp_path: Path, pre: str) -> None:
    trained = train_byte_level_bpe(pre)
    path = write_tokenizer_gguf(
        tmp_path / f"{pre}.gguf",
        trained,
        pre=pre,
        architecture="qwen2" if pre == "qwen2" else "llama",
        special_ids={"bos": 0, "eos": 2},
        add_bos=pre == "llama-bpe",
        chat_template=CHATML_TEMPLATE,
    )
    ours = load_tokenizer(str(path))
    reference = hf_gguf_tokenizer(path)
    # transformers gives smollm files GPT-2's plain pre-tokenizer (no digit split): compare text
    # without digits there; the tokenizer.json comparison below covers digits.
    texts = [t for t in CORPUS if pre != "smollm" or not any(c.isdigit() for c in t)]
    # transformers skips Qwen2's NFC normalizer for GGUF files: compare NFC text there.
    texts = [unicodedata.normalize("NFC", t) for t in texts]
    assert_same_encoding(ours, reference, texts)
    assert ours.vocab_size == len(reference)
    assert ours.chat_template == CHATML_TEMPLATE


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_tiny_gguf_matches_the_trained_tokenizer(tmp_path: Path, pre: str) -> None:
    # The trained tokenizer has the model family's tokenizer.json layout (Llama 3: ignore_merges).
    trained = train_byte_level_bpe(pre)
    if pre == "llama-bpe":
        trained = _with_ignore_merges(trained)
    ours = load_tokenizer(str(write_tokenizer_gguf(tmp_path / "t.gguf", trained, pre=pre, add_bos=False)))
    for text in [*CORPUS, "e\u0301te\u0301 NFD text", "x 12 y1 2023-01-02 ½ ²"]:
        assert ours.encode(text) == trained.encode(text).ids, text
        assert ours.decode(ours.encode(text)) == trained.decode(
            trained.encode(text).ids, skip_special_tokens=False
        )


def _with_ignore_merges(tokenizer: HfBackend) -> HfBackend:
    import json

    document = json.loads(tokenizer.to_str())
    document["model"]["ignore_merges"] = True
    return HfBackend.from_str(json.dumps(document))


def test_qwen2_gguf_normalizes_like_the_qwen2_tokenizer(tmp_path: Path) -> None:
    trained = train_byte_level_bpe("qwen2")
    tokens, merges = vocab_and_merges(trained)
    reference = transformers.Qwen2Tokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]
    )
    ours = load_tokenizer(str(write_tokenizer_gguf(tmp_path / "q.gguf", trained, pre="qwen2")))
    for text in ["e\u0301te\u0301 cafe\u0301", "Ångström", *CORPUS[:6]]:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text


def test_bos_follows_add_bos_token(tmp_path: Path) -> None:
    trained = train_byte_level_bpe("llama-bpe")
    base = {"bos": 0, "eos": 2}
    with_bos = load_tokenizer(
        str(write_tokenizer_gguf(tmp_path / "a.gguf", trained, pre="llama-bpe", special_ids=base))
    )
    without = load_tokenizer(
        str(
            write_tokenizer_gguf(
                tmp_path / "b.gguf", trained, pre="llama-bpe", special_ids=base, add_bos=False
            )
        )
    )
    plain = trained.encode("hello world").ids
    # llama-bpe files without the flag add BOS, as llama.cpp does for Llama 3.
    assert with_bos.encode("hello world") == [0, *plain]
    assert with_bos.encode("hello world", add_special_tokens=False) == plain
    assert without.encode("hello world") == plain


def test_user_defined_and_eot_tokens(tmp_path: Path) -> None:
    trained = train_byte_level_bpe("qwen2")
    num = trained.get_vocab_size()
    think, end_think = num, num + 1
    path = write_tokenizer_gguf(
        tmp_path / "t.gguf",
        trained,
        pre="qwen2",
        extra_tokens=["<think>", "</think>"],
        token_types={think: 4, end_think: 4},
        special_ids={"eos": 2, "eot": 1},
    )
    ours = load_tokenizer(str(path))
    ids = ours.encode("<think>hm</think>ok<|im_end|>")
    assert ids[0] == think and end_think in ids and ids[-1] == 2
    # user-defined tokens are matched whole but are not special: skip_special_tokens keeps them.
    assert ours.decode(ids, skip_special_tokens=True) == "<think>hm</think>ok"
    assert ours.decode(ids) == "<think>hm</think>ok<|im_end|>"
    assert ours.eos_token_ids == frozenset({1, 2})
    assert think not in ours.all_special_ids and 2 in ours.all_special_ids
    assert ours.vocab_size == num + 2


def test_metadata_reader_matches_gguf_reader(tmp_path: Path) -> None:
    trained = train_byte_level_bpe("smollm")
    path = write_tokenizer_gguf(
        tmp_path / "m.gguf", trained, pre="smollm", special_ids={"bos": 0, "eos": 2}, add_bos=True
    )
    ours = read_gguf_metadata(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours[key] == field.contents(), key


def test_unsupported_files_raise_model_load_error(tmp_path: Path) -> None:
    trained = train_byte_level_bpe("gpt2")
    with pytest.raises(ModelLoadError, match=r"not supported.*llama-bpe.*qwen2.*smollm"):
        load_tokenizer(str(write_tokenizer_gguf(tmp_path / "x.gguf", trained, pre="mystery")))
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        load_tokenizer(str(not_gguf))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes((tmp_path / "x.gguf").read_bytes()[:200])
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(truncated))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.gguf"))


def test_metadata_without_a_usable_tokenizer_is_a_load_error() -> None:
    with pytest.raises(
        ModelLoadError, match=r"tokenizer model 't5' is not supported.*'llama', SentencePiece"
    ):
        tokenizer_from_gguf_metadata({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.model": "t5"})
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.ggml\.tokens"):
        tokenizer_from_gguf_metadata({"general.architecture": "llama"})


def test_supported_pre_tokenizer_names() -> None:
    assert {"gpt2", "default", "smollm", "llama-bpe", "qwen2"} <= set(PRE_TOKENIZERS)


# ---- the shared tiny checkpoints (tests/fixtures) ------------------------------------------------


def test_fixture_checkpoint_folder_and_its_gguf_agree(tiny_llama_dir: str, tiny_llama_gguf: str) -> None:
    from_folder = load_tokenizer(tiny_llama_dir)
    from_gguf = load_tokenizer(tiny_llama_gguf)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_llama_dir)
    assert_same_encoding(from_folder, reference, CORPUS)
    assert_same_encoding(from_gguf, hf_gguf_tokenizer(Path(tiny_llama_gguf)), CORPUS)
    for text in CORPUS:
        assert from_gguf.encode(text) == from_folder.encode(text), text
    assert from_gguf.vocab_size == from_folder.vocab_size == len(reference)
    assert from_gguf.eos_token_id == from_folder.eos_token_id == reference.eos_token_id
    assert from_gguf.eos_token_id in from_folder.eos_token_ids
    assert from_gguf.bos_token_id == from_folder.bos_token_id == reference.bos_token_id
    assert from_gguf.all_special_ids == from_folder.all_special_ids
    messages = [{"role": "user", "content": "Hi!"}]
    assert (
        from_gguf.apply_chat_template(messages)
        == from_folder.apply_chat_template(messages)
        == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
