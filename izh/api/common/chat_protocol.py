"""Chat completions' request and response bodies (OpenAI's, plus vLLM's extensions) as pydantic models.

Shared by chat's routes, the Responses route (which maps onto a chat request), /tokenize (which renders
chat messages) and the shared request handling (images, constraints, logprobs). Requests ignore unknown
fields, as izh.api.common.protocol's do.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from izh.api.common.protocol import RequestBase, SamplingFields, UsageInfo

# --- /v1/chat/completions -----------------------------------------------------------------------


class ContentPart(BaseModel):
    """One typed part of a message's content: "text", or "image_url" for a vision-language model (a URL
    string, or {"url", "detail"}; checked by izh.api.common.images). Other types are refused when rendered."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: str | dict[str, Any] | None = None


class FunctionCallParam(RequestBase):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(RequestBase):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(RequestBase):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(RequestBase):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(RequestBase):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(RequestBase):
    name: str


class NamedToolChoice(RequestBase):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions.
    echo: bool = False
    add_generation_prompt: bool | None = None
    """None: true unless continue_final_message."""
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None
    refusal: list[ChatLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """The assistant's answer; `reasoning_content` and `reasoning` carry the same text (both names
    are in use by clients: DeepSeek's API and vLLM wrote `reasoning_content`, newer vLLM `reasoning`)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaFunctionCall(BaseModel):
    """A streamed piece of a call's function: the name once, then argument fragments."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaToolCall(BaseModel):
    """A streamed piece of tool call `index`: the first carries id, type and function.name, the
    later ones only argument fragments that concatenate to the arguments' JSON."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaMessage(BaseModel):
    """A streamed piece of the message: only the keys that carry something are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
