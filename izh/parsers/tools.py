"""Which tool-call parser: the formats by name (Hermes/Qwen and Llama 3 JSON), and the one a chat
template's tool format calls for. The parsers' behaviour is izh.parsers.tool_calls'.
"""

from __future__ import annotations

from izh.parsers.hermes import HERMES_START, HermesToolParser
from izh.parsers.llama3 import PYTHON_TAG, Llama3JsonToolParser
from izh.parsers.tool_calls import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template's tool format calls for: hermes unless it looks like Llama 3's."""
    template = chat_template or ""
    if HERMES_START in template:
        return "hermes"
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def select_tool_parser(name: str, chat_template: str | None) -> type[ToolParser] | None:
    """The parser class for a configured name: "none" → None, "auto" → from the template.

    Raises ValueError for an unknown name, listing the supported ones.
    """
    if name == "none":
        return None
    if name == "auto":
        name = detect_tool_parser(chat_template)
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        supported = ", ".join(["auto", "none", *TOOL_PARSERS])
        raise ValueError(f"unknown tool call parser {name!r}; supported: {supported}")
    return parser
