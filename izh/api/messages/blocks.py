"""The checks every Anthropic content block, tool and tool_choice shares (izh.api.messages.convert and
izh.api.messages.tools): refusals naming the exact field, and the keys that change nothing here."""

from __future__ import annotations

from typing import Any

from izh.errors import InvalidRequest

_HINT_KEYS = frozenset({"cache_control"})
"""Keys any block or tool may carry that change nothing here."""


def unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code="unsupported")


def check_keys(block: dict[str, Any], allowed: set[str], param: str) -> None:
    """Refuse a key outside `allowed` that holds something (clients echo a response's blocks back with
    its null fields, e.g. a tool_use's `caller: null`)."""
    for key, value in block.items():
        if value is None or (key == "caller" and value == {"type": "direct"}):
            continue  # unset, or the model calling the tool itself (the only caller here)
        if key not in allowed and key not in _HINT_KEYS:
            raise unsupported(f"{param}.{key}", f"the field {key!r} is not supported here")


def text_of(block: dict[str, Any], param: str) -> str:
    check_keys(block, {"type", "text", "citations"}, param)
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{param}.text: a text block needs a string 'text'", param=f"{param}.text")
    if block.get("citations"):
        raise unsupported(f"{param}.citations", "citations are not supported")
    return text


def as_block(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest(f"{param}: expected a content block with a 'type'", param=param)
    return value
