"""The Tokenizer: a `tokenizers.Tokenizer` plus the model's special tokens, eos ids and chat templates."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models

from izh.errors import InvalidRequest
from izh.tokenizer.chat_template import ChatTemplateRenderer

logger = logging.getLogger(__name__)

# The special tokens HF passes to chat templates by name (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 onwards.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


def byte_level_token_bytes(token: str) -> bytes:
    """The bytes tokenizers' ByteLevel decoder turns one token into.

    A token spelled wholly in the byte alphabet maps char by char; any other token (an added token
    such as "\\n\\n" or "日本") passes through as its UTF-8 encoding.
    """
    try:
        return bytes([_UNICODE_TO_BYTE[char] for char in token])
    except KeyError:
        return token.encode("utf-8")


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens, eos ids and chat templates.

    Thread-safe for concurrent encode/decode (the backend is). `encode(..., add_special_tokens=True)`
    adds BOS/EOS exactly when the model's post-processor says so; encode rendered chat prompts with
    `add_special_tokens=False`, since templates write their own BOS.

    Attributes: `eos_token_ids` is every id that ends generation (the eos token, generation_config's
    eos_token_id, GGUF eot/eom ids); `all_special_ids` is every id skip_special_tokens drops (all
    special added tokens, a superset of transformers' named ones); `vocab_size` counts added tokens;
    `special_tokens` maps names such as "bos_token" to contents (chat template variables);
    `is_byte_level` says decode() is the UTF-8 decoding of the concatenated token_bytes.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """`special_tokens` maps names in SPECIAL_TOKEN_NAMES to token contents; each is registered
        as a special token in `backend` (added to it if missing, like transformers does).
        `chat_templates` maps template names to sources; "default" is the model's chat template.
        """
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.special_tokens = _register_special_tokens(backend, special_tokens or {})
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.pad_token_id = self._special_id("pad_token")
        self.unk_token_id = self._special_id("unk_token")
        eos_ids = {*extra_eos_token_ids, *_generation_config_eos_ids(generation_config or {})}
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.vocab_size: int = vocab_size if vocab_size is not None else backend.get_vocab_size(True)
        self.is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._renderer = ChatTemplateRenderer()
        self._token_bytes: list[bytes] | None = None
        self._detokenizer_tables: dict[bool, list[bytes]] = {}
        self._warn_on_broken_templates()

    # ---- encoding and decoding -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. "<|im_start|>") match whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int | None]:
        """A text pair as one sequence, as transformers' tokenizer(first, second) encodes it for a
        cross-encoder (the post-processor's pair template: `[CLS] a [SEP] b [SEP]`, `<s> a </s></s> b
        </s>`), and where its token type 1 starts (None when every token is type 0).

        Raises ValueError when the types are not 0s then 1s (a template izh cannot pass as one start).
        """
        encoding = self.backend.encode(first, pair=second, add_special_tokens=True)
        types = encoding.type_ids
        start = types.index(1) if 1 in types else None
        if start is not None and any(t != 1 for t in types[start:]):
            raise ValueError("the tokenizer's pair template interleaves its token types")
        return encoding.ids, start

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; invalid UTF-8 becomes U+FFFD, ids outside the vocabulary decode to "".
        No clean-up of spaces is applied. InvalidRequest for ids that are not 32-bit unsigned."""
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise InvalidRequest(f"token ids must be integers in [0, {self.vocab_size}): {exc}") from None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `ids` ("" for an id the vocabulary lacks)."""
        id_to_token = self.backend.id_to_token
        return [id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (b"" for an unknown id)."""
        table = self._byte_table()
        return table[token_id] if 0 <= token_id < len(table) else b""

    def detokenizer_table(self, skip_special_tokens: bool) -> list[bytes]:
        """`token_bytes` for every id, with special tokens mapped to b"" when they are skipped.

        Only meaningful for byte-level tokenizers, where decode() is exactly the UTF-8 decoding
        of the concatenated bytes. Built once per flag and shared by every detokenizer.
        """
        table = self._detokenizer_tables.get(skip_special_tokens)
        if table is None:
            table = list(self._byte_table())
            if skip_special_tokens:
                for token_id in self.all_special_ids:
                    if token_id < len(table):
                        table[token_id] = b""
            self._detokenizer_tables[skip_special_tokens] = table
        return table

    def _byte_table(self) -> list[bytes]:
        if self._token_bytes is None:
            self._token_bytes = self._build_byte_table()
        return self._token_bytes

    def _build_byte_table(self) -> list[bytes]:
        size = max(self.vocab_size, self.backend.get_vocab_size(True))
        added = {i: token.content for i, token in self.backend.get_added_tokens_decoder().items()}
        id_to_token = self.backend.id_to_token
        table: list[bytes] = []
        for token_id in range(size):
            token = id_to_token(token_id)
            if token is None:
                table.append(b"")
            elif self.is_byte_level:
                table.append(byte_level_token_bytes(token))
            elif token_id in added:
                table.append(token.encode("utf-8"))
            else:
                table.append(self._plain_token_bytes(token))
        return table

    def _plain_token_bytes(self, token: str) -> bytes:
        # SentencePiece-style vocabularies: byte-fallback tokens stand for one byte, "▁" for a space.
        match = _BYTE_FALLBACK_TOKEN.fullmatch(token)
        if match and isinstance(self.backend.model, models.BPE) and self.backend.model.byte_fallback:
            return bytes([int(match.group(1), 16)])
        return token.replace(_METASPACE, " ").encode("utf-8")

    # ---- special tokens and templates ------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def chat_template(self) -> str | None:
        """The model's default chat template source, or None."""
        return self.chat_templates.get("default")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, rendered like transformers' apply_chat_template.

        `chat_template` is a template source or the name of one of the model's templates; by
        default the model's ("tool_use" when tools are given and the model has one). Extra kwargs
        (e.g. enable_thinking) become template variables. Raises InvalidRequest for a missing
        template, a template error, a sandbox violation or raise_exception() in the template.
        """
        source = self._select_template(chat_template, tools)
        return self._renderer.render(
            source,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables={**self.special_tokens, **kwargs},
        )

    def _select_template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            names = ", ".join(sorted(self.chat_templates))
            raise InvalidRequest(
                f"This model has several chat templates and no default; name one of: {names}",
                param="chat_template",
            )
        raise InvalidRequest(
            "This model has no chat template; pass one in the request's chat_template field",
            param="chat_template",
        )

    def override_chat_template(self, source: str) -> None:
        """Serve `source` as the model's chat template (server.chat_template): it replaces "default"
        and the model's "tool_use" one (the override renders tools too); other named templates stay.

        Raises ValueError when it does not compile.
        """
        try:
            self._renderer.compile(source)
        except InvalidRequest as exc:
            raise ValueError(f"the chat template does not compile: {exc.message}") from None
        self.chat_templates.pop("tool_use", None)
        self.chat_templates["default"] = source

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    def _warn_on_broken_templates(self) -> None:
        # Compiling now surfaces a broken template in the load log; requests still get InvalidRequest.
        for name, source in self.chat_templates.items():
            try:
                self._renderer.compile(source)
            except InvalidRequest as exc:
                logger.warning("chat template %r does not compile: %s", name, exc.message)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, templates={sorted(self.chat_templates)})"
        )


def _register_special_tokens(
    backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str]
) -> dict[str, str]:
    """Make each named special token a special added token of `backend`; returns the usable ones."""
    added = backend.get_added_tokens_decoder()
    special_contents = {token.content for token in added.values() if token.special}
    registered: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = special_tokens.get(name)
        if not content:
            continue
        if content not in special_contents:
            backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            special_contents.add(content)
        registered[name] = content
    return registered


def _generation_config_eos_ids(generation_config: Mapping[str, Any]) -> list[int]:
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return [eos]
    if isinstance(eos, list):
        return [i for i in eos if isinstance(i, int) and not isinstance(i, bool)]
    return []
