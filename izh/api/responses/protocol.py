"""OpenAI's Responses API bodies as pydantic models: the request, the Response object and its output
items, and the stored-response listings.

The request's `input` items stay plain JSON here: izh.api.responses.items reads them one by one, so
that a refusal names the item (`input.3.content.0.type`). Fields izh cannot honour are typed
loosely and refused by name in izh.api.responses.routes (never silently dropped); fields OpenAI's own
server ignores or that only describe the caller (`user`, `safety_identifier`, `prompt_cache_key`)
are echoed back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from izh.api.common.protocol import RequestBase

# --- the request ---------------------------------------------------------------------------------


class TextFormat(RequestBase):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or a named JSON schema."""

    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestBase):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(RequestBase):
    """`reasoning`: what each value does here is izh.api.responses.reasoning's docstring."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(RequestBase):
    include_obfuscation: bool | None = None


class ResponsesRequest(RequestBase):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    # Refused unless unset (izh.api.responses.routes names each): no background runs, conversations,
    # reusable prompts, built-in tool limits or service tiers here.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None


# --- output items ----------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class LogprobTop(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class OutputLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[LogprobTop]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: ItemStatus


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    namespace: str | None = None
    """The namespace tool the function came from (izh.api.responses.tools)."""


class CustomToolCallItem(BaseModel):
    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    status: ItemStatus


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem | CustomToolCallItem


# --- the Response object ---------------------------------------------------------------------------


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache."""
    cache_write_tokens: int = 0
    """OpenAI's explicit cache writes; izh's prefix cache has none (its caching is implicit)."""


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """OpenAI's Response: the request's settings echoed, the output items, status and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(BaseModel):
    """GET /v1/responses/{id}/input_items: a page of the response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str = ""
    last_id: str = ""
    has_more: bool = False
