"""A Responses request's `reasoning` settings, and reasoning sealed for the client to send back.

`reasoning.summary` (auto, concise, detailed): the reasoning item carries the model's reasoning text
as its one summary part, streamed with the response.reasoning_summary_* events. izh does not write
a shorter summary, so the three values do the same; unset, the summary stays empty (the text is in
the item's content either way). A model without a reasoning parser makes no reasoning item at all.
`reasoning.effort`: "none" turns thinking off for templates that know `enable_thinking` (Qwen3's);
any other value (minimal, low, medium, high, xhigh) leaves the model to think as it does: izh sets
no thinking budget.

`include: ["reasoning.encrypted_content"]` (clients that send `store: false`, such as Codex, keep
their reasoning this way): each reasoning item carries `encrypted_content`, its text sealed with the
server's key (`ReasoningSeal`), which izh opens when the item comes back in a later request's input.
Clients can neither read it nor forge it; one sealed by another server (or before a restart with a
generated key) is a 400.

The seal, standard library only (no new dependency): keys for encryption and authentication are
derived from the server key with HMAC-SHA256; the text is XORed with an HMAC-SHA256 keystream over
a random 16-byte nonce and a block counter (a PRF in counter mode), then the version, nonce and
ciphertext are authenticated with HMAC-SHA256 (encrypt-then-MAC), checked in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

from izh.errors import InvalidRequest

ENCRYPTED_CONTENT_INCLUDE = "reasoning.encrypted_content"
SUMMARY_VALUES = ("auto", "concise", "detailed")
EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh")
_VERSION = b"\x01"
_NONCE_BYTES = 16
_TAG_BYTES = 32
_BLOCK_BYTES = 32  # one SHA-256 output


class ReasoningSeal:
    """Seals reasoning text into an opaque token and opens tokens it sealed (see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the reasoning key needs at least 16 bytes")
        self._encryption_key = hmac.digest(key, b"izh reasoning encryption", hashlib.sha256)
        self._mac_key = hmac.digest(key, b"izh reasoning authentication", hashlib.sha256)

    @classmethod
    def generated(cls) -> ReasoningSeal:
        """A seal with a fresh random key: tokens open only in this server process."""
        return cls(secrets.token_bytes(32))

    def seal(self, text: str) -> str:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        body = _VERSION + nonce + self._xor(nonce, text.encode())
        tag = hmac.digest(self._mac_key, body, hashlib.sha256)
        return base64.urlsafe_b64encode(body + tag).decode()

    def open(self, token: str, param: str) -> str:
        """The text `token` seals; a 400 naming `param` when it is not a token this seal made."""
        try:
            raw = base64.urlsafe_b64decode(token.encode("ascii"))
        except (ValueError, binascii.Error):
            raw = b""
        body, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        valid = (
            len(raw) >= 1 + _NONCE_BYTES + _TAG_BYTES
            and body[:1] == _VERSION
            and hmac.compare_digest(tag, hmac.digest(self._mac_key, body, hashlib.sha256))
        )
        if not valid:
            raise InvalidRequest(
                f"{param}: the encrypted reasoning was not sealed by this server (altered, or from "
                "another server or an earlier run); send the reasoning without it",
                param=param,
                code="invalid_encrypted_content",
            )
        nonce = body[1 : 1 + _NONCE_BYTES]
        try:
            return self._xor(nonce, body[1 + _NONCE_BYTES :]).decode()
        except UnicodeDecodeError:  # sealed by this key, so never; kept a 400 all the same
            raise InvalidRequest(f"{param}: not valid UTF-8 once opened", param=param) from None

    def _xor(self, nonce: bytes, data: bytes) -> bytes:
        stream = bytearray()
        for counter in range((len(data) + _BLOCK_BYTES - 1) // _BLOCK_BYTES):
            stream += hmac.digest(self._encryption_key, nonce + counter.to_bytes(8, "big"), hashlib.sha256)
        return bytes(a ^ b for a, b in zip(data, stream, strict=False))


def check_reasoning(effort: str | None, summary: str | None, generate_summary: str | None) -> None:
    """400 naming the field for a value OpenAI does not define."""
    for param, value, allowed in (
        ("reasoning.effort", effort, EFFORT_VALUES),
        ("reasoning.summary", summary, SUMMARY_VALUES),
        ("reasoning.generate_summary", generate_summary, SUMMARY_VALUES),
    ):
        if value is not None and value not in allowed:
            raise InvalidRequest(f"{param}: expected one of {', '.join(allowed)}, got {value!r}", param=param)
