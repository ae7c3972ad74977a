"""Anthropic's Messages API request bodies as pydantic models.

Unlike OpenAI's bodies (izh.api.protocol), unknown top-level fields are refused, as Anthropic's own API
refuses them: a field izh does not implement (`mcp_servers`, `container`, `context_management`, ...) is
a 400 naming it, never silently ignored. Content blocks, tools and tool_choice stay plain dicts here:
izh.api.messages.convert checks them one by one, so that a refusal names the exact block
(`messages.2.content.1.type`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Metadata(_Strict):
    """Anthropic's request metadata: only `user_id`, an opaque id of the end user (logged)."""

    user_id: str | None = Field(default=None, max_length=256)


class ThinkingConfig(_Strict):
    """`{"type": "enabled", "budget_tokens": N}`, `{"type": "disabled"}` or `{"type": "adaptive"}`
    (the model decides: a reasoning model thinks, another does not)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized"] | None = None
    """"summarized" (thinking returned as written) only: izh never omits the thinking it parsed."""


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """`output_config`: its `format` (a JSON schema the answer must follow, enforced by the grammar);
    `effort` cannot be controlled for these models (a 400 when set)."""

    format: OutputFormat | None = None
    effort: str | None = None


class _Prompted(_Strict):
    """What both routes render into the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None
    """Accepted: the prefix cache serves a repeated prefix whatever the client marks."""


class MessagesRequest(_Prompted):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    """Accepted: izh has one tier, which satisfies both values."""


class CountTokensRequest(_Prompted):
    """POST /v1/messages/count_tokens."""
