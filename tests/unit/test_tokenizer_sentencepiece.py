"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Gemma, Phi-3)
encode and decode exactly like transformers' GGUF tokenizer, on tiny files written with `gguf` and on
the real Gemma 3 270M."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizer_helpers import CORPUS, write_sentencepiece_gguf
from tokenizers import Tokenizer as HfBackend
from tokenizers import pre_tokenizers

from izh.tokenizer import Tokenizer, load_tokenizer
from izh.tokenizer.builtin_templates import GEMMA_CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

# Multilingual, whitespace- and byte-heavy: runs of spaces and newlines, tabs, control bytes, emoji and
# scripts outside the tiny vocabularies (byte fallback), and control pieces written in the text.
TEXTS = [
    *CORPUS,
    "  leading\n\n\n  and   triple   spaces\t\ttab\n \n",
    "bytes: \x00\x01\x7f \ufffd \U0001f9ec 𝔘𝔫𝔦 ẞ ǅ",
    "ελληνικά हिन्दी ไทย עברית Ελλάδα",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "a<think>b</think> <bos>x<eos> <s>y</s>",
    "\u2581already\u2581metaspace\u2581",
]


def hf_gguf_tokenizer(path: Path) -> Any:
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_as_transformers(ours: Tokenizer, reference: Any) -> None:
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=True)
        assert ours.encode(text) == expected, text
        decoded = reference.decode(expected, clean_up_tokenization_spaces=False)
        assert ours.decode(expected) == decoded, text


@pytest.mark.parametrize(
    ("architecture", "add_bos", "add_space_prefix"),
    [
        ("llama", None, None),  # Llama 2 / Mistral / TinyLlama: Metaspace with a prefix space, BOS
        ("llama", True, True),
        ("llama", False, True),
        ("gemma3", None, None),  # Gemma: spaces replaced, no prefix, merges in vocabulary order
        ("gemma2", False, False),
        ("phi3", True, True),  # Phi-3: the prefix space from a normalizer
    ],
)
def test_tiny_sentencepiece_gguf_matches_transformers(
    tmp_path: Path, architecture: str, add_bos: bool | None, add_space_prefix: bool | None
) -> None:
    path = write_sentencepiece_gguf(
        tmp_path / "sp.gguf", architecture=architecture, add_bos=add_bos, add_space_prefix=add_space_prefix
    )
    ours = load_tokenizer(path)
    assert_same_as_transformers(ours, hf_gguf_tokenizer(path))
    assert (ours.encode("x")[0] == ours.bos_token_id) == (add_bos is not False)
    assert not ours.is_byte_level
    # Byte fallback: a character outside the vocabulary is its UTF-8 bytes, and decodes back.
    snake = ours.encode("🐍", add_special_tokens=False)
    assert [ours.token_bytes(i) for i in snake][-4:] == [bytes([b]) for b in "🐍".encode()]
    assert ours.decode(snake) in ("🐍", " 🐍")


def test_llama_without_space_prefix_follows_the_file(tmp_path: Path) -> None:
    # add_space_prefix=false (llama.cpp honours it): no "▁" before the first word. transformers' GGUF
    # loader ignores the flag, so the reference here is the same vocabulary with Metaspace "never".
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf", add_space_prefix=False)
    ours = load_tokenizer(path)
    reference = HfBackend.from_str(hf_gguf_tokenizer(path).backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text).ids, text
    assert ours.convert_ids_to_tokens(ours.encode("the", add_special_tokens=False))[0][0] != "\u2581"


def test_gemma_files_without_a_template_get_gemmas(tmp_path: Path) -> None:
    ours = load_tokenizer(write_sentencepiece_gguf(tmp_path / "g.gguf", architecture="gemma3"))
    assert ours.chat_template == GEMMA_CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    # <end_of_turn> ends a reply although the file names no eot id (as llama.cpp finds it).
    assert ours.token_to_id("<end_of_turn>") in ours.eos_token_ids
    # A file's own template wins over the built-in one.
    own = load_tokenizer(
        write_sentencepiece_gguf(tmp_path / "own.gguf", architecture="gemma3", chat_template="{{ 'x' }}")
    )
    assert own.chat_template == "{{ 'x' }}"
    assert load_tokenizer(write_sentencepiece_gguf(tmp_path / "l.gguf")).chat_template is None


def test_gemma3_270m_matches_transformers(gemma3_gguf: str) -> None:
    ours = load_tokenizer(gemma3_gguf)
    path = Path(gemma3_gguf)
    assert_same_as_transformers(ours, hf_gguf_tokenizer(path))
    assert ours.vocab_size == 262144
    assert ours.bos_token_id == 2 and ours.eos_token_ids == frozenset({1, 106})
    prompt = ours.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ours.encode(prompt, add_special_tokens=False) == [
        2,
        105,
        2364,
        107,
        10979,
        106,
        107,
        105,
        4368,
        107,
    ]
