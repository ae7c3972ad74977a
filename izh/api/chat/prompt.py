"""Chat messages → the prompt: messages normalised to what chat templates expect, tools rendered by
the template or (a template without tool support) as a Hermes system prompt, then the template
rendered and the text tokenized.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from izh.api.common.chat_protocol import (
    ChatMessageParam,
    ToolCallParam,
    ToolParam,
)
from izh.errors import InvalidRequest
from izh.parsers.hermes import HERMES_END, HERMES_START, render_tools_system_prompt
from izh.tokenizer import Tokenizer

if TYPE_CHECKING:
    from izh.api.common.images import ChatImage
    from izh.engine_messages import ImageInput
    from izh.frontend.image_processor import Idefics3ImageProcessor

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
    for j, part in enumerate(content):
        if part.type == "image_url":
            raise InvalidRequest(
                f"messages[{index}]: image_url parts are accepted in user messages only",
                param=f"messages.{index}.content.{j}",
            )
        if part.type != "text":
            raise InvalidRequest(
                f"messages[{index}]: content parts of type {part.type!r} are not supported (text and "
                "image_url only)",
                param=f"messages.{index}.content.{j}",
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


def _image_message_parts(message: ChatMessageParam, index: int) -> list[dict[str, Any]] | None:
    """A user message's content as a VLM template's parts ({"type": "text"} / {"type": "image"}) when it
    holds an image; None when it holds none."""
    content = message.content
    if message.role != "user" or not isinstance(content, list) or all(p.type != "image_url" for p in content):
        return None
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type == "image_url":
            parts.append({"type": "image"})
        elif part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        else:
            raise InvalidRequest(
                f"messages[{index}]: content parts must be text (with a 'text') or image_url",
                param=f"messages.{index}.content.{j}",
            )
    return parts


def template_messages(
    messages: list[ChatMessageParam], *, hermes_tools: bool = False, content_parts: bool = False
) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (HF's conventions).

    `hermes_tools` (a template without tool support): an assistant's tool calls become Hermes
    `<tool_call>` blocks in its content, and tool results `<tool_response>` blocks in a user
    message (consecutive results share one), as Hermes-trained models expect.

    `content_parts` (a vision-language model, whose template iterates over typed parts): a user message
    with images keeps its parts in order, images as {"type": "image"} (the template writes the image
    marker); every other content is made a list of one text part by `as_content_parts`.
    """
    result: list[dict[str, Any]] = []
    after_tool_result = False
    for index, message in enumerate(messages):
        # Most templates know only "system"; OpenAI's "developer" means the same to an open model.
        role = "system" if message.role == "developer" else message.role
        parts = _image_message_parts(message, index) if content_parts else None
        if parts is not None:
            after_tool_result = False
            item: dict[str, Any] = {"role": role, "content": parts}
            if message.name is not None:
                item["name"] = message.name
            result.append(item)
            continue
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
        item = {"role": role, "content": text if text is not None else ""}
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


def as_content_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every text content as a list of one text part (a VLM template's shape); parts lists stay."""
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
        for m in messages
    ]


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
    """The rendered template (a VLM's image markers not yet expanded)."""
    token_ids: list[int]
    template: str | None = None
    hermes_tools: bool = False
    """The tools (and tool history) were written as Hermes text: the template has no tool support."""
    images: list[ImageInput] = field(default_factory=list)
    """A VLM's images, preprocessed and placed in `token_ids`."""


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
    image_processor: Idefics3ImageProcessor | None,
    images: list[ChatImage],
) -> tuple[str, list[int], list[ImageInput]]:
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        **chat_template_kwargs,
    )

    def encode(t: str) -> list[int]:
        return tokenizer.encode(t, add_special_tokens=add_special_tokens)

    if image_processor is None:
        return text, encode(text), []
    if not images:
        token_ids = encode(text)
        if image_processor.image_token_id in token_ids:
            raise InvalidRequest(
                "messages: the text holds the model's image placeholder token; send images as image_url parts",
                param="messages",
            )
        return text, token_ids, []
    try:
        token_ids, inputs = image_processor.build_prompt(
            text,
            [(image.image, image.content_hash) for image in images],
            encode,
            low_detail=[image.detail == "low" for image in images],
        )
    except ValueError as e:
        raise InvalidRequest(
            f"messages: the images do not fit the rendered prompt ({e}); is the image placeholder written "
            "as text, or does the chat template drop images?",
            param="messages",
        ) from None
    return text, token_ids, inputs


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
    image_processor: Idefics3ImageProcessor | None = None,
    images: list[ChatImage] | None = None,
) -> ChatPrompt:
    """Render the chat through the template (sandboxed) and tokenize it, off the event loop.

    `add_generation_prompt` None means "unless continuing the final message" (asking for both is
    a 400 from the renderer). `tools` go to the template when it supports them, else into the
    system message in the Hermes format (`render_tools_system_prompt`). `chat_template_kwargs`
    (e.g. enable_thinking) become template variables. A vision-language model (`image_processor`) gets
    its messages as typed parts, and `images` (izh.api.common.images, in message order) are preprocessed and
    their placeholders expanded into the prompt.
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
    content_parts = image_processor is not None
    chat = template_messages(messages, hermes_tools=hermes_tools, content_parts=content_parts)
    if tool_dicts is not None and hermes_tools:
        chat = with_tools_prompt(chat, render_tools_system_prompt(tool_dicts))
        tool_dicts = None
    if content_parts:
        chat = as_content_parts(chat)
    text, token_ids, inputs = await asyncio.to_thread(
        _render_and_encode,
        tokenizer,
        chat,
        tool_dicts,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        add_special_tokens=add_special_tokens,
        image_processor=image_processor,
        images=images or [],
    )
    return ChatPrompt(text, token_ids, template, hermes_tools=hermes_tools and bool(tools), images=inputs)
