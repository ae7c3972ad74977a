"""Building the Tokenizer of a GGUF file from its metadata.

A GGUF carries no tokenizer.json: it has the vocabulary (`tokenizer.ggml.tokens`), the merges, the
token types, the special ids, and a name for the pre-tokenizer (`tokenizer.ggml.pre`) whose regex
llama.cpp compiles in. We rebuild the tokenizer.json the model's HF tokenizer has (the same
pre-tokenizer, normalizer and BPE options) and hand it to `tokenizers` in one `from_str` call, which
is much faster than building the BPE model through the Python API.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from izh.errors import ModelLoadError, UnsupportedModel
from izh.tokenizer.builtin_templates import BUILTIN_CHAT_TEMPLATES
from izh.tokenizer.gguf_metadata import read_gguf_metadata
from izh.tokenizer.sentencepiece_gguf import sentencepiece_document
from izh.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's token types (llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# The split regexes of the models' own tokenizer.json files (llama.cpp rewrites them for its engine).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict[str, Any]:
    # With use_regex, ByteLevel first splits with GPT-2's regex:
    # 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_bytes(regex: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _byte_level(use_regex=False)]}


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """How one `tokenizer.ggml.pre` name tokenizes, as in that model family's tokenizer.json."""

    pre_tokenizer: dict[str, Any]
    normalizer: dict[str, Any] | None = None
    # Llama 3 looks a whole pre-token up in the vocabulary before merging (BPE ignore_merges).
    ignore_merges: bool = False
    # Whether BOS is added when the file has no tokenizer.ggml.add_bos_token (llama.cpp's defaults).
    add_bos_default: bool = False


_GPT2 = PreTokenizerSpec(_byte_level(use_regex=True))
_SMOLLM = PreTokenizerSpec(
    # SmolLM's tokenizer.json: each digit alone (llama.cpp: "\p{N}"), then GPT-2's regex.
    {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)],
    }
)
_LLAMA3 = PreTokenizerSpec(_split_then_bytes(_LLAMA3_REGEX), ignore_merges=True, add_bos_default=True)
# Qwen2's tokenizer.json NFC-normalizes first (llama.cpp does not; we follow the model's tokenizer).
_QWEN2 = PreTokenizerSpec(_split_then_bytes(_QWEN2_REGEX), normalizer={"type": "NFC"})

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "smollm": _SMOLLM,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
}


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The Tokenizer described by a GGUF file's metadata.

    Raises ModelLoadError for a file without a tokenizer, a tokenizer model other than byte-level
    BPE ("gpt2"), or a pre-tokenizer name we do not know.
    """
    metadata = read_gguf_metadata(path)
    return tokenizer_from_gguf_metadata(metadata, source=str(path))


def tokenizer_from_gguf_metadata(metadata: dict[str, Any], *, source: str = "GGUF") -> Tokenizer:
    """The Tokenizer for already-read GGUF metadata (see load_gguf_tokenizer)."""
    tokens = _require(metadata, "tokenizer.ggml.tokens", source)
    model = metadata.get("tokenizer.ggml.model")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    ids = _special_ids(metadata, len(tokens))
    if model == "gpt2":
        pre_name = metadata.get("tokenizer.ggml.pre", "default")
        spec = PRE_TOKENIZERS.get(pre_name)
        if spec is None:
            raise UnsupportedModel(
                f"{source}: pre-tokenizer {pre_name!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        merges = _require(metadata, "tokenizer.ggml.merges", source)
        add_bos_default = spec.add_bos_default
        document = _tokenizer_json(tokens, token_types, merges, spec)
    elif model == "llama":
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        add_bos_default = True
        document = _sentencepiece_json(metadata, tokens, token_types, ids)
        if "eot_token_id" not in ids:
            ids.update(_end_of_turn_id(tokens, token_types))
    else:
        raise UnsupportedModel(
            f"{source}: tokenizer model {model!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece)"
        )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    document["post_processor"] = _post_processor(tokens, ids, add_bos=add_bos, add_eos=add_eos)
    try:
        backend = tokenizers.Tokenizer.from_str(json.dumps(document, ensure_ascii=False))
    except Exception as exc:
        raise ModelLoadError(f"{source}: cannot build the tokenizer from GGUF metadata: {exc}") from exc
    special_tokens = {name: tokens[token_id] for name, token_id in ids.items() if name.endswith("_token")}
    extra_eos = [ids[name] for name in ("eot_token_id", "eom_token_id") if name in ids]
    return Tokenizer(
        backend,
        special_tokens=special_tokens,
        extra_eos_token_ids=extra_eos,
        chat_templates=_chat_templates(metadata),
        generation_config={},
        vocab_size=len(tokens),
    )


def _sentencepiece_json(
    metadata: dict[str, Any], tokens: list[str], token_types: list[int], ids: dict[str, int]
) -> dict[str, Any]:
    architecture = str(metadata.get("general.architecture", "llama"))
    unk_id = ids.get("unk_token")
    document = sentencepiece_document(
        architecture,
        tokens,
        metadata.get("tokenizer.ggml.scores"),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
    )
    document["added_tokens"] = _added_tokens(tokens, token_types, document["model"]["vocab"])
    return document


# Turn-end pieces that end a chat reply although the file names no eot id (llama.cpp finds them by text).
_END_OF_TURN_PIECES = ("<end_of_turn>", "<|end|>", "<|eot_id|>", "<|im_end|>")


def _end_of_turn_id(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=False)):
        if token_type == _CONTROL and token in _END_OF_TURN_PIECES:
            return {"eot_token_id": token_id}
    return {}


def _require(metadata: dict[str, Any], key: str, source: str) -> Any:
    value = metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{source}: GGUF metadata has no {key}, so it carries no usable tokenizer")
    return value


def _special_ids(metadata: dict[str, Any], num_tokens: int) -> dict[str, int]:
    """{"bos_token": id, ..., "eot_token_id": id} for the ids the file sets and that exist."""
    keys = {
        "bos_token": "tokenizer.ggml.bos_token_id",
        "eos_token": "tokenizer.ggml.eos_token_id",
        "unk_token": "tokenizer.ggml.unknown_token_id",
        "pad_token": "tokenizer.ggml.padding_token_id",
        "eot_token_id": "tokenizer.ggml.eot_token_id",
        "eom_token_id": "tokenizer.ggml.eom_token_id",
    }
    ids = {}
    for name, key in keys.items():
        value = metadata.get(key)
        if isinstance(value, int) and 0 <= value < num_tokens:
            ids[name] = value
        elif value is not None:
            logger.warning("ignoring GGUF %s=%r: not a token id", key, value)
    return ids


def _tokenizer_json(
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    spec: PreTokenizerSpec,
) -> dict[str, Any]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        # setdefault keeps the first id of a duplicated string; the later one decodes to "".
        if vocab.setdefault(token, token_id) != token_id:
            logger.warning("GGUF vocabulary repeats token %r (ids %d and %d)", token, vocab[token], token_id)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, token_types, vocab),
        "normalizer": spec.normalizer,
        "pre_tokenizer": spec.pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": spec.ignore_merges,
            "vocab": vocab,
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }


def _added_tokens(tokens: list[str], token_types: list[int], vocab: dict[str, int]) -> list[dict[str, Any]]:
    """Control tokens as special added tokens, user-defined ones (e.g. <think>) as plain added tokens.

    Both are matched whole in text, as llama.cpp does. User-defined tokens stay non-special, as in
    the models' tokenizer.json, so that skip_special_tokens keeps "<think>" in the output.
    """
    added = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types, strict=False)):
        if token_type not in (_CONTROL, _USER_DEFINED) or vocab.get(token) != token_id or not token:
            continue
        added.append(
            {
                "id": token_id,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": token_type == _CONTROL,
            }
        )
    return added


def _post_processor(
    tokens: list[str], ids: dict[str, int], *, add_bos: bool, add_eos: bool
) -> dict[str, Any] | None:
    bos = ids.get("bos_token") if add_bos else None
    eos = ids.get("eos_token") if add_eos else None
    if bos is None and eos is None:
        return None
    return _template_processing(
        bos=(tokens[bos], bos) if bos is not None else None,
        eos=(tokens[eos], eos) if eos is not None else None,
    )


def _chat_templates(metadata: dict[str, Any]) -> dict[str, str]:
    """The file's chat templates: "default" from tokenizer.chat_template (else the family's built-in
    one, see builtin_templates), named ones after it."""
    templates = {}
    default = metadata.get("tokenizer.chat_template")
    if not isinstance(default, str):
        default = BUILTIN_CHAT_TEMPLATES.get(str(metadata.get("general.architecture")))
    if default is not None:
        templates["default"] = default
    prefix = "tokenizer.chat_template."
    for key, value in metadata.items():
        if key.startswith(prefix) and isinstance(value, str):
            templates[key[len(prefix) :]] = value
    return templates


def _template_processing(*, bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> dict[str, Any]:
    """tokenizer.json's TemplateProcessing putting `bos` (content, id) before and `eos` after each
    sequence, as transformers' update_post_processor builds it. JSON, because the Python API's
    "content:type_id" strings cannot spell tokens holding ':' or spaces."""

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if bos is not None:
            items.append({"SpecialToken": {"id": bos[0], "type_id": type_id}})
        items.append({"Sequence": {"id": name, "type_id": type_id}})
        if eos is not None:
            items.append({"SpecialToken": {"id": eos[0], "type_id": type_id}})
        return items

    specials = {
        content: {"id": content, "ids": [i], "tokens": [content]} for content, i in filter(None, (bos, eos))
    }
    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": specials,
    }
