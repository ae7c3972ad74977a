"""Incremental detokenization: the new text of each step of a stream, in O(new tokens).

Byte-level BPE (every model izh serves) decodes to exactly the UTF-8 decoding of the concatenated
token bytes, so the fast path maps ids to bytes through a table shared by all streams and feeds an
incremental UTF-8 decoder, which holds back a split character until its last byte arrives. Other
tokenizers (SentencePiece-style decoders) fall back to re-decoding a small window of tokens, like
vLLM's prefix/read offsets.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from izh.tokenizer.tokenizer import Tokenizer

# Prompt tokens the windowed path decodes in front of the output, so that a decoder which treats
# the first token specially (e.g. strips a leading space) sees the output in context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one stream's output token ids into text deltas.

    The deltas of add() concatenate to `tokenizer.decode(output_ids, skip_special_tokens=...)`
    once the stream ends with `finished=True`. A character split across tokens is held back until
    complete (never a U+FFFD for it); a genuinely invalid byte sequence becomes U+FFFD as in
    decode(), at the latest when the stream finishes. `prompt_token_ids` only give context to the
    windowed path of non-byte-level tokenizers (there the text is the output as read after the
    prompt, vLLM's convention).
    """

    __slots__ = ("_chunks", "_decoder", "_finished", "_table", "_window")

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._chunks: list[str] = []
        self._finished = False
        self._table: list[bytes] | None = None
        self._decoder: codecs.IncrementalDecoder | None = None
        self._window: _WindowDecoder | None = None
        if tokenizer.is_byte_level:
            self._table = tokenizer.detokenizer_table(skip_special_tokens)
            self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
            self._window = _WindowDecoder(tokenizer, skip_special_tokens, context)

    def add(self, token_ids: Sequence[int], *, finished: bool = False) -> str:
        """The text the new `token_ids` complete ("" while a character is still split).

        `finished=True` marks the stream's end: whatever is held back is flushed (an incomplete
        character becomes U+FFFD, as decode() renders it). Adding after that is an error.
        """
        if self._finished:
            raise RuntimeError("add() after the stream finished")
        self._finished = finished
        if self._decoder is not None and self._table is not None:
            table = self._table
            size = len(table)
            data = b"".join([table[i] if 0 <= i < size else b"" for i in token_ids])
            delta = self._decoder.decode(data, finished)
        else:
            assert self._window is not None
            delta = self._window.add(token_ids, finished)
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        return self._finished


class _WindowDecoder:
    """vLLM's windowed incremental decode for tokenizers whose decoder is not plain byte-level.

    `_token_ids[prefix_offset:read_offset]` is text already emitted, kept as context; the delta is
    decode(prefix..end) minus decode(prefix..read), emitted once it no longer ends in U+FFFD.
    """

    __slots__ = ("_prefix_offset", "_read_offset", "_skip_special_tokens", "_token_ids", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, context_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = context_ids
        self._prefix_offset = 0
        self._read_offset = len(context_ids)

    def add(self, token_ids: Sequence[int], finished: bool) -> str:
        self._token_ids.extend(token_ids)
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._token_ids[self._prefix_offset : self._read_offset], skip)
        full_text = decode(self._token_ids[self._prefix_offset :], skip)
        if len(full_text) <= len(prefix_text) and not finished:
            return ""
        if full_text.endswith(_REPLACEMENT) and not finished:
            # Most likely a character split across byte-fallback tokens: wait for the rest.
            return ""
        delta = full_text[len(prefix_text) :]
        # Drop what is no longer needed as context, so each call decodes only a few tokens.
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        return delta
