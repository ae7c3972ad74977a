"""The incremental detokenizer: deltas concatenate to decode() of the whole output, split UTF-8
characters are held back (never a U+FFFD for them), special tokens are skipped on request."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_helpers import SMOLLM2_GGUF, train_byte_level_bpe, train_sentencepiece_like, write_hf_folder
from tokenizers import AddedToken

from izh.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from izh.tokenizer.tokenizer import bytes_to_unicode


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    backend = train_byte_level_bpe("qwen2")
    # Non-special added tokens: ASCII ones map through the byte alphabet, "\n\n" and "日本" do not.
    backend.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "\n\n", "日本")])
    return load_tokenizer(str(write_hf_folder(tmp_path_factory.mktemp("bl"), backend)))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = write_hf_folder(
        tmp_path_factory.mktemp("sp"),
        train_sentencepiece_like(),
        tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"},
    )
    return load_tokenizer(str(folder))


def stream(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    chunk_sizes: Sequence[int] = (1,),
    *,
    skip_special_tokens: bool = True,
    prompt_token_ids: Sequence[int] | None = None,
) -> list[str]:
    """The deltas of streaming `ids` in chunks of the given sizes (cycled), the last finishing."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=skip_special_tokens, prompt_token_ids=prompt_token_ids
    )
    deltas = []
    start = 0
    step = 0
    while start < len(ids):
        size = max(1, chunk_sizes[step % len(chunk_sizes)])
        chunk = ids[start : start + size]
        start += size
        step += 1
        deltas.append(detokenizer.add(chunk, finished=start >= len(ids)))
    if not ids:
        deltas.append(detokenizer.add([], finished=True))
    assert detokenizer.text == "".join(deltas)
    return deltas


def test_emoji_and_cjk_split_across_byte_tokens(byte_level: Tokenizer) -> None:
    text = "a🦀b 🇫🇷 👨‍👩‍👧 世界 鳥 é𝄞"
    ids = byte_level.encode(text)
    # Characters the tiny vocabulary never saw are split into byte tokens.
    assert sum(not _is_utf8(byte_level.token_bytes(i)) for i in ids) >= 8
    deltas = stream(byte_level, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    # A split character yields "" until its last byte arrives, then the whole character.
    assert "" in deltas and "🦀" in deltas and "鳥" in deltas


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_special_tokens_skipped_or_kept(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("<|im_start|>hi<think>x\n\n日本<|im_end|>", add_special_tokens=False)
    assert "".join(stream(byte_level, ids)) == "hi<think>x\n\n日本"
    kept = "".join(stream(byte_level, ids, skip_special_tokens=False))
    assert kept == "<|im_start|>hi<think>x\n\n日本<|im_end|>"
    assert kept == byte_level.decode(ids)


def test_incomplete_character_at_the_end_becomes_replacement(byte_level: Tokenizer) -> None:
    # "ok" and the first three of the crab emoji's four bytes, one byte token each.
    crab_bytes = [byte_level.token_to_id(bytes_to_unicode()[b]) for b in "🦀".encode()[:3]]
    cut = [*byte_level.encode("ok "), *crab_bytes]
    detokenizer = IncrementalDetokenizer(byte_level)
    assert detokenizer.add(cut) == "ok "
    assert detokenizer.add([], finished=True) == "\ufffd"
    assert detokenizer.text == byte_level.decode(cut)
    with pytest.raises(RuntimeError):
        detokenizer.add([1])


def test_prompt_is_ignored_by_byte_level(byte_level: Tokenizer) -> None:
    prompt = byte_level.encode("Hello")
    output = byte_level.encode(" world 😀")
    assert "".join(stream(byte_level, output, prompt_token_ids=prompt)) == " world 😀"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(min_value=0, max_value=620), max_size=40),
    chunk_sizes=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_random_ids_concatenate_to_decode(
    byte_level: Tokenizer, ids: list[int], chunk_sizes: list[int], skip: bool
) -> None:
    # Random ids hit byte tokens in any order: valid, split and invalid UTF-8 alike.
    deltas = stream(byte_level, ids, chunk_sizes, skip_special_tokens=skip)
    assert "".join(deltas) == byte_level.decode(ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=30), chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_valid_text_never_yields_replacement(
    byte_level: Tokenizer, text: str, chunk_sizes: list[int]
) -> None:
    text = text.replace("\ufffd", "")
    ids = byte_level.encode(text, add_special_tokens=False)
    deltas = stream(byte_level, ids, chunk_sizes, skip_special_tokens=False)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == byte_level.decode(ids)


@pytest.mark.skipif(SMOLLM2_GGUF is None, reason="SmolLM2 GGUF not installed")
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=30), skip=st.booleans())
def test_smollm2_random_ids_concatenate_to_decode(ids: list[int], skip: bool) -> None:
    tokenizer = _smollm2()
    assert "".join(stream(tokenizer, ids, (2,), skip_special_tokens=skip)) == tokenizer.decode(ids, skip)


@functools.cache
def _smollm2() -> Tokenizer:
    return load_tokenizer(str(SMOLLM2_GGUF))


# ---- the windowed path (non-byte-level decoders) ------------------------------------------------


def test_sentencepiece_like_uses_the_window_and_holds_split_characters(sentencepiece: Tokenizer) -> None:
    assert not sentencepiece.is_byte_level
    text = "Hello 😀 world 你好"
    ids = sentencepiece.encode(text, add_special_tokens=False)
    deltas = stream(sentencepiece, ids)
    assert "".join(deltas) == sentencepiece.decode(ids) == text
    assert not any("\ufffd" in delta for delta in deltas)
    # The window keeps only the last few tokens as context, however long the stream.
    detokenizer = IncrementalDetokenizer(sentencepiece)
    for token_id in ids * 20:
        detokenizer.add([token_id])
    assert detokenizer._window is not None and len(detokenizer._window._token_ids) <= 8
    assert detokenizer.text == sentencepiece.decode(ids * 20, skip_special_tokens=True)


def test_sentencepiece_like_prompt_gives_context(sentencepiece: Tokenizer) -> None:
    prompt = sentencepiece.encode("Hello", add_special_tokens=False)
    # Encoded alone, "world" starts with "▁" (the normalizer prepends one): a word after a space.
    output = sentencepiece.encode("world", add_special_tokens=False)
    # Alone, decode() strips the output's leading space; after the prompt it is kept (vLLM's way).
    assert sentencepiece.decode(output) == "world"
    assert "".join(stream(sentencepiece, output, prompt_token_ids=prompt)) == " world"
    assert "".join(stream(sentencepiece, output)) == "world"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(max_size=30),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    skip=st.booleans(),
)
def test_sentencepiece_like_text_streams_concatenate_to_decode(
    sentencepiece: Tokenizer, text: str, chunk_sizes: list[int], skip: bool
) -> None:
    text = text.replace("\ufffd", "")
    ids = [1, *sentencepiece.encode(text, add_special_tokens=False), 2]
    deltas = stream(sentencepiece, ids, chunk_sizes, skip_special_tokens=skip)
    assert "".join(deltas) == sentencepiece.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in delta for delta in deltas)


def test_shared_tables_are_built_once(byte_level: Tokenizer) -> None:
    first = IncrementalDetokenizer(byte_level)
    second = IncrementalDetokenizer(byte_level)
    assert first._table is second._table
    assert IncrementalDetokenizer(byte_level, skip_special_tokens=False)._table is not first._table


def test_empty_stream(byte_level: Tokenizer, tmp_path: Path) -> None:
    assert stream(byte_level, []) == [""]
