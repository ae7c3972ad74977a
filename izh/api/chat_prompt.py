"""Chat messages → the prompt: messages normalised to what chat templates expect, tools rendered by
the template or (a template without tool support) as a Hermes system prompt, then the template
rendered and the text tokenized.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from izh.api.protocol import ChatMessageParam, ToolCallParam, ToolParam
from izh.errors import InvalidRequest
from izh.parsers.hermes import HERMES_END, HERMES_START, render_tools_system_prompt
from izh.tokenizer import Tokenizer

# Names the renderer itself passes to a template: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


def message_text(message: ChatMessageParam, index: int) -> str | None:
    """A message's content as text: typed text parts joined with newlines (vLLM's rule)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text":
            raise InvalidRequest(
                f"messages[{index}]: content parts of type {part.type!r} are not supported (text only)",
                param=f"messages.{index}.content",
            )
        if part.text is None:
            raise InvalidRequest(
                f"messages[{index}]: a text content part needs a 'text' field",
                param=f"messages.{index}.content",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _arguments_value(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments as an object when they are a JSON object's text.

    Templates render arguments with `| tojson`: a JSON string would come out double-encoded.
    """
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        if isinstance(parsed, dict):
            return parsed
    return arguments


def _tool_call_dict(call: ToolCallParam) -> dict[str, Any]:
    result: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)},
    }
    if call.id is not None:
        result["id"] = call.id
    return result


def _hermes_call_text(call: ToolCallParam) -> str:
    body = {"name": call.function.name, "arguments": _arguments_value(call.function.arguments)}
    return f"{HERMES_START}\n{json.dumps(body, ensure_ascii=False)}\n{HERMES_END}"


def template_messages(
    messages: list[ChatMessageParam], *, hermes_tools: bool = False
) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (HF's conventions).

    `hermes_tools` (a template without tool support): an assistant's tool calls become Hermes
    `<tool_call>` blocks in its content, and tool results `<tool_response>` blocks in a user
    message (consecutive results share one), as Hermes-trained models expect.
    """
    result: list[dict[str, Any]] = []
    after_tool_result = False
    for index, message in enumerate(messages):
        # Most templates know only "system"; OpenAI's "developer" means the same to an open model.
        role = "system" if message.role == "developer" else message.role
        text = message_text(message, index)
        if hermes_tools and role == "tool":
            response = f"<tool_response>\n{text or ''}\n</tool_response>"
            if after_tool_result:
                result[-1]["content"] += "\n" + response
            else:
                result.append({"role": "user", "content": response})
            after_tool_result = True
            continue
        after_tool_result = False
        item: dict[str, Any] = {"role": role, "content": text if text is not None else ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls and hermes_tools:
            blocks = "\n".join(_hermes_call_text(call) for call in message.tool_calls)
            item["content"] = f"{text}\n{blocks}" if text else blocks
        elif message.tool_calls:
            item["tool_calls"] = [_tool_call_dict(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if reasoning is not None:
            item["reasoning_content"] = reasoning
        result.append(item)
    return result


def with_tools_prompt(messages: list[dict[str, Any]], tools_prompt: str) -> list[dict[str, Any]]:
    """`messages` with the tools section after the first system message's text (or as a new one)."""
    if messages and messages[0]["role"] == "system":
        system = messages[0]["content"]
        first = {**messages[0], "content": f"{system}\n\n{tools_prompt}" if system else tools_prompt}
        return [first, *messages[1:]]
    return [{"role": "system", "content": tools_prompt}, *messages]


def template_source(tokenizer: Tokenizer, chat_template: str | None, *, with_tools: bool) -> str | None:
    """The template the renderer will use (its selection rule), or None when there is none."""
    templates = tokenizer.chat_templates
    if chat_template is not None:
        return templates.get(chat_template, chat_template)
    if with_tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (SmolLM2's, for one, never mentions them)."""
    return template is not None and "tools" in template


@dataclass(slots=True)
class ChatPrompt:
    text: str
    token_ids: list[int]
    template: str | None = None
    hermes_tools: bool = False
    """The tools (and tool history) were written as Hermes text: the template has no tool support."""


def _render_and_encode(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any],
    add_special_tokens: bool,
) -> tuple[str, list[int]]:
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        **chat_template_kwargs,
    )
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessageParam],
    *,
    tools: list[ToolParam] | None,
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    add_special_tokens: bool,
) -> ChatPrompt:
    """Render the chat through the template (sandboxed) and tokenize it, off the event loop.

    `add_generation_prompt` None means "unless continuing the final message" (asking for both is
    a 400 from the renderer). `tools` go to the template when it supports them, else into the
    system message in the Hermes format (`render_tools_system_prompt`). `chat_template_kwargs`
    (e.g. enable_thinking) become template variables.
    """
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    tool_dicts = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    template = template_source(tokenizer, chat_template, with_tools=tool_dicts is not None)
    hermes_tools = not supports_tools(template)
    chat = template_messages(messages, hermes_tools=hermes_tools)
    if tool_dicts is not None and hermes_tools:
        chat = with_tools_prompt(chat, render_tools_system_prompt(tool_dicts))
        tool_dicts = None
    text, token_ids = await asyncio.to_thread(
        _render_and_encode,
        tokenizer,
        chat,
        tool_dicts,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        add_special_tokens=add_special_tokens,
    )
    return ChatPrompt(text, token_ids, template, hermes_tools=hermes_tools and bool(tools))
