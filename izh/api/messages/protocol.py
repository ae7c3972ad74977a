"""Anthropic's Messages API request bodies as pydantic models.

Unlike OpenAI's bodies (izh.api.protocol), unknown top-level fields are refused, as Anthropic's own API
refuses them: a field izh does not implement (`mcp_servers`, `container`, ...) is a 400 naming it, never
silently ignored. Content blocks, tools and tool_choice stay plain dicts here:
izh.api.messages.convert checks them one by one, so that a refusal names the exact block
(`messages.2.content.1.type`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageParam(_Strict):
    role: Literal["user", "assistant", "system"]
    """"system": a system turn within the conversation (Claude Code's environment notes), joined to the
    user turn beside it as a <system-reminder> (convert._fold_system_turns)."""
    content: str | list[dict[str, Any]]


class Metadata(_Strict):
    """Anthropic's request metadata: only `user_id`, an opaque id of the end user (logged)."""

    user_id: str | None = Field(default=None, max_length=256)


class ThinkingConfig(_Strict):
    """`{"type": "enabled", "budget_tokens": N}`, `{"type": "disabled"}` or `{"type": "adaptive"}`
    (the model decides: a reasoning model thinks, another does not)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "highlights", "updates", "omitted"] | None = None
    """"summarized" (the default), "highlights", "updates" (Claude Code's, headless with stream-json):
    thinking blocks carry the thinking as the model wrote it, streamed as it comes (izh writes no
    shorter form of it); "omitted": their `thinking` is empty and their `signature` holds it sealed
    with the server's key, so that izh reads it back when the block returns in a later request."""


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """`output_config`: its `format` (a JSON schema the answer must follow, enforced by the grammar) and
    `effort`: how many tokens the model should spend, a hint Anthropic's models follow. izh sets no
    thinking budget, so every value leaves the model to think and answer as it does (as the Responses
    API's `reasoning.effort` other than "none"); an unknown value is a 400."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class ContextManagement(_Strict):
    """`context_management`: edits applied to the conversation before it is rendered. Each edit is
    checked by izh.api.messages.convert (`clear_thinking_20251015` only; others are a 400)."""

    edits: list[dict[str, Any]] = Field(default_factory=list)


class _Prompted(_Strict):
    """What both routes render into the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: dict[str, Any] | None = None
    """Accepted: the prefix cache serves a repeated prefix whatever the client marks."""


class MessagesRequest(_Prompted):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    """The most tokens to generate, clamped to the room the prompt leaves in the context (agents send
    their model's output limit, e.g. 32000): a message that stops at the end of the context ends with
    stop_reason "model_context_window_exceeded", as Anthropic's does."""
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
