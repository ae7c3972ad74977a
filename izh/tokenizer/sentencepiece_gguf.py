"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model = "llama"`) as tokenizer.json.

Llama 2, Mistral, Gemma, Phi-3 and TinyLlama files carry a SentencePiece BPE vocabulary: the pieces
(spaces written as "▁"), one score per piece, the token types (control, user-defined, byte) and no
merges. `tokenizers` runs such a vocabulary as a BPE model with byte fallback once the merges are
recovered from the vocabulary: every split of a piece into two pieces is a merge, ranked by the
piece's score (Gemma: by its position, since its scores do not follow its merge order). The
normalizer, pre-tokenizer and decoder are those of the family's own tokenizer.json (Llama: Metaspace;
Gemma: spaces replaced, no prefix; Phi-3: a prepended "▁"), so that ids equal transformers' GGUF
tokenizer and the models' reference tokenizers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_SPACE = "\u2581"
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
_PHI3_ARCHITECTURES = frozenset({"phi3"})


def sentencepiece_vocab(architecture: str, tokens: Sequence[str]) -> list[str]:
    """The pieces as the BPE model spells them: Gemma files store runs of spaces as real spaces,
    which its normalizer turns into "▁" before lookup, so those pieces are respelled."""
    if architecture not in _GEMMA_ARCHITECTURES:
        return list(tokens)
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def recover_merges(
    tokens: Sequence[str], vocab: Mapping[str, int], scores: Mapping[str, float]
) -> list[list[str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Each piece contributes every split into two known pieces; merges rank by the piece's score
    (higher first), then by the longer left and right part, as transformers' generate_merges ranks
    them (its order is what the reference tokenizer runs).
    """
    ranked: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = []
        for index in range(1, len(piece)):
            left, right = piece[:index], piece[index:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in ranked]


def sentencepiece_document(
    architecture: str,
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    *,
    unk_token: str | None,
    add_space_prefix: bool,
) -> dict[str, Any]:
    """tokenizer.json (without added tokens and post-processor) for a SentencePiece GGUF vocabulary."""
    pieces = sentencepiece_vocab(architecture, tokens)
    # A repeated piece keeps its last id, as transformers' vocabulary dict does.
    vocab = {piece: token_id for token_id, piece in enumerate(pieces)}
    gemma = architecture in _GEMMA_ARCHITECTURES
    if gemma or scores is None:
        # Gemma's merge order is its vocabulary order; a file without scores gets the same.
        rank: dict[str, float] = {piece: -token_id for token_id, piece in enumerate(pieces)}
    else:
        rank = dict(zip(pieces, (float(s) for s in scores), strict=False))
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    normalizer: dict[str, Any] | None = None
    pre_tokenizer: dict[str, Any] | None = None
    if gemma:
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
        pre_tokenizer = {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        }
    elif architecture in _PHI3_ARCHITECTURES:
        normalizer = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": _SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE},
            ],
        }
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    else:
        scheme = "first" if add_space_prefix else "never"
        pre_tokenizer = {"type": "Metaspace", "replacement": _SPACE, "prepend_scheme": scheme, "split": False}
        if add_space_prefix:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk_token if gemma else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": recover_merges(pieces, vocab, rank),
        },
    }
