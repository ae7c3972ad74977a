"""Which tool-call parser: the formats by name (vLLM's names), and the one a chat template's tool
format calls for (`--tool-call-parser auto`). The parsers' behaviour is izh.parsers.tool_calls'.
"""

from __future__ import annotations

from izh.parsers.deepseek import CALLS_BEGIN, DeepSeekV3ToolParser
from izh.parsers.harmony import HarmonyToolParser, is_harmony_template
from izh.parsers.hermes import HERMES_START, HermesToolParser
from izh.parsers.json_formats import (
    GRANITE_TOOL_CALL,
    MISTRAL_TOOL_CALLS,
    GraniteToolParser,
    MistralToolParser,
    Phi4MiniJsonToolParser,
)
from izh.parsers.llama3 import PYTHON_TAG, Llama3JsonToolParser
from izh.parsers.pythonic import PYTHON_START, PythonicToolParser
from izh.parsers.qwen3_coder import FUNCTION_START, PARAMETER_START, Qwen3CoderToolParser
from izh.parsers.tool_calls import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "granite": GraniteToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "harmony": HarmonyToolParser,
    "openai": HarmonyToolParser,
}

_PYTHONIC_HINTS = (PYTHON_START, "[func_name1(params_name1=params_value1")
"""Llama 4's python tags; Llama 3.2's pythonic instructions (its tool-calling system prompt)."""


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template's tool format calls for, from the markers it writes; hermes when none."""
    template = chat_template or ""
    if is_harmony_template(template):
        return "harmony"  # gpt-oss: calls are commentary messages to functions.NAME
    if FUNCTION_START in template and PARAMETER_START in template:
        return "qwen3_coder"  # before hermes: its calls sit inside <tool_call> too
    if CALLS_BEGIN in template:
        return "deepseek_v3"
    if MISTRAL_TOOL_CALLS in template:
        return "mistral"
    if GRANITE_TOOL_CALL in template:
        return "granite"
    if "functools[" in template or "<|tool|>" in template:
        return "phi4_mini_json"
    if any(hint in template for hint in _PYTHONIC_HINTS):
        return "pythonic"
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
