"""Anthropic Messages bodies → the chat requests they mean (izh.api.messages.convert): system blocks,
tool_result blocks as tool messages in order, tool_use / thinking blocks on the assistant message,
images as data URLs, tool_choice and thinking mapped, echoed null fields accepted, and every block,
tool or field izh cannot honour a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest

from izh.api.messages.convert import Conversion, chat_request
from izh.api.messages.protocol import CountTokensRequest, MessagesRequest
from izh.api.responses.reasoning import ReasoningSeal
from izh.errors import InvalidRequest

TOOL = {
    "name": "get_weather",
    "description": "Weather.",
    "input_schema": {"type": "object", "properties": {}},
}


def _body(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 64, **fields})


def test_a_tool_round_trip_conversation() -> None:
    body = _body(
        system=[
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use tools."},
        ],
        messages=[
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two cities.", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                        "caller": None,
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                        "caller": {"type": "direct"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "down"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=5,
    )
    chat = chat_request(body, reasoning=True)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\nUse tools."
    assistant = chat.messages[2]
    assert assistant.content == "Checking." and assistant.reasoning_content == "Two cities."
    assert [
        (c.id, c.function.name, json.loads(str(c.function.arguments))) for c in assistant.tool_calls or []
    ] == [
        ("toolu_1", "get_weather", {"city": "Paris"}),
        ("toolu_2", "get_weather", {"city": "Oslo"}),
    ]
    assert [(m.tool_call_id, m.content) for m in chat.messages[3:5]] == [
        ("toolu_1", "sunny"),
        ("toolu_2", "Error: down"),
    ]
    assert chat.tools is not None and chat.tools[0].function.parameters == TOOL["input_schema"]
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.max_tokens == 64


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, "get_weather"),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: str) -> None:
    chat = chat_request(
        _body(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice), reasoning=False
    )
    got = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.function.name  # type: ignore[union-attr]
    assert got == expected


def test_an_image_block_is_a_data_url_part() -> None:
    body = _body(
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ]
    )
    (message,) = chat_request(body, reasoning=False).messages
    assert isinstance(message.content, list)
    assert message.content[0].image_url == {"url": "data:image/png;base64,AAAA"}
    assert message.content[1].text == "What is it?"


def test_thinking() -> None:
    disabled = _body(messages=[{"role": "user", "content": "x"}], thinking={"type": "disabled"})
    assert chat_request(disabled, reasoning=True).chat_template_kwargs == {"enable_thinking": False}
    adaptive = _body(messages=[{"role": "user", "content": "x"}], thinking={"type": "adaptive"})
    assert chat_request(adaptive, reasoning=False).chat_template_kwargs is None
    enabled = _body(
        messages=[{"role": "user", "content": "x"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        max_tokens=2048,
    )
    assert chat_request(enabled, reasoning=True).chat_template_kwargs is None
    with pytest.raises(InvalidRequest, match="does not think"):
        chat_request(enabled, reasoning=False)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "surprise": 1}]}]},
            "messages.0.content.0.surprise",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0.type",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "t"}]}, "tools.0.input_schema"),
        ({"tools": [{**TOOL, "input_examples": [{}]}]}, "tools.0.input_examples"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking.budget_tokens"),
        (
            {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            "context_management.edits.0.type",
        ),
        (
            {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}},
            "context_management.edits.0.keep",
        ),
        (
            {"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"tools": [{**TOOL, "defer_loading": True}], "tool_choice": {"type": "any"}},
            "tool_choice",
        ),
    ],
)
def test_what_izh_cannot_honour_names_its_field(fields: dict[str, Any], param: str) -> None:
    body = _body(**{"messages": [{"role": "user", "content": "x"}], **fields})
    with pytest.raises(InvalidRequest) as refused:
        chat_request(body, reasoning=True)
    assert refused.value.param == param


def test_count_tokens_takes_no_sampling_fields() -> None:
    body = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}
    )
    chat = chat_request(body, reasoning=False)
    assert chat.max_tokens is None and chat.tools is not None


def test_the_guard_bounds_messages_bodies_naming_their_fields() -> None:
    from izh.api.guard.limits import RequestLimits
    from izh.errors import LimitExceeded
    from izh.settings import LimitSettings

    limits = RequestLimits(LimitSettings(max_stop=2, max_tools=1, max_messages=2), max_model_len=1024)
    check = limits.checker("/v1/messages")
    assert check is not None and limits.checker("/v1/messages/count_tokens") is not None
    base: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    check(base)
    for fields, param in (
        ({"stop_sequences": ["a", "b", "c"]}, "stop_sequences"),
        ({"tools": [TOOL, TOOL]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}] * 3}, "messages"),
    ):
        with pytest.raises(LimitExceeded) as refused:
            check({**base, **fields})
        assert refused.value.param == param


def _reminder(text: str) -> tuple[str, str]:
    return ("text", f"<system-reminder>\n{text}\n</system-reminder>\n")


def _parts(message: Any) -> Any:
    content = message.content
    return content if isinstance(content, str) else [(part.type, part.text) for part in content]


def test_system_turns_in_the_conversation_join_the_user_turn_beside_them() -> None:
    """Claude Code sends its environment as a system turn after the user's task: it becomes a reminder
    after the task in that user message (a small model echoed it when it stood as a system message just
    before its reply); one after an assistant turn joins the next user message, before its text and
    after the tool results; one with no user message beside it stays a system message."""
    body = _body(
        system="Be brief.",
        messages=[
            {"role": "user", "content": "Run it."},
            {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {}}]},
            {"role": "system", "content": "Second."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            {"role": "system", "content": "Mode changed."},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                    {"type": "text", "text": "Go on."},
                ],
            },
            {"role": "assistant", "content": "Done."},
            {"role": "system", "content": "Reminder."},
        ],
    )
    chat = chat_request(body, reasoning=False)
    assert [(m.role, _parts(m)) for m in chat.messages] == [
        ("system", "Be brief."),
        ("user", [("text", "Run it."), _reminder("# Environment"), _reminder("Second.")]),
        ("assistant", ""),
        ("tool", "ok"),
        ("user", [_reminder("Mode changed."), ("text", "Go on.")]),
        ("assistant", "Done."),
        ("system", "Reminder."),
    ]


def _thinking_turns(*thoughts: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for index, thought in enumerate(thoughts):
        messages.append({"role": "user", "content": f"q{index}"})
        text = {"type": "text", "text": f"a{index}"}
        messages.append({"role": "assistant", "content": [{"type": "thinking", "thinking": thought}, text]})
    return [*messages, {"role": "user", "content": "last"}]


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        ("all", ["t0", "t1", "t2"]),
        (None, [None, None, "t2"]),  # Anthropic's default: the latest turn
        ({"type": "thinking_turns", "value": 2}, [None, "t1", "t2"]),
        ({"type": "thinking_turns", "value": 5}, ["t0", "t1", "t2"]),
    ],
)
def test_clear_thinking_keeps_the_latest_turns(keep: Any, kept: list[str | None]) -> None:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"} | ({"keep": keep} if keep is not None else {})
    body = _body(messages=_thinking_turns("t0", "t1", "t2"), context_management={"edits": [edit]})
    conversion = Conversion()
    chat = chat_request(body, reasoning=True, conversion=conversion)
    assistants = [m for m in chat.messages if m.role == "assistant"]
    assert [m.reasoning_content for m in assistants] == kept
    assert [m.content for m in assistants] == ["a0", "a1", "a2"]
    assert conversion.context_edits
    assert conversion.cleared_thinking == [
        t for t, k in zip(["t0", "t1", "t2"], kept, strict=True) if k is None
    ]


def test_without_context_edits_every_thinking_stays() -> None:
    conversion = Conversion()
    chat = chat_request(_body(messages=_thinking_turns("t0", "t1")), reasoning=True, conversion=conversion)
    assert [m.reasoning_content for m in chat.messages if m.role == "assistant"] == ["t0", "t1"]
    assert conversion == Conversion()


def test_deferred_tools_are_rendered_once_a_tool_reference_loads_them() -> None:
    placeholder = {"name": "Placeholder", "description": "x", "input_schema": TOOL["input_schema"]}
    tools = [
        {**placeholder, "defer_loading": True},
        {**TOOL, "defer_loading": True},
        {**TOOL, "name": "Bash"},
    ]
    first = chat_request(_body(messages=[{"role": "user", "content": "x"}], tools=tools), reasoning=False)
    assert [tool.function.name for tool in first.tools or []] == ["Bash"]
    loaded = _body(
        tools=tools,
        messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "tool_reference", "tool_name": "get_weather"}],
                    }
                ],
            },
        ],
    )
    chat = chat_request(loaded, reasoning=False)
    assert [tool.function.name for tool in chat.tools or []] == ["get_weather", "Bash"]
    assert chat.messages[-1].role == "tool" and chat.messages[-1].content == "Tool loaded: get_weather"
    only_deferred = _body(
        messages=[{"role": "user", "content": "x"}], tools=tools[:2], tool_choice={"type": "auto"}
    )
    none_loaded = chat_request(only_deferred, reasoning=False)
    assert none_loaded.tools is None and none_loaded.tool_choice is None


def test_omitted_thinking_is_read_back_from_its_sealed_signature() -> None:
    seal = ReasoningSeal.generated()

    def body(block: dict[str, Any]) -> MessagesRequest:
        return _body(
            messages=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [block, {"type": "text", "text": "a"}]},
                {"role": "user", "content": "again"},
            ]
        )

    omitted = {"type": "thinking", "thinking": "", "signature": seal.seal("I thought.")}
    chat = chat_request(body(omitted), reasoning=True, open_signature=seal.open)
    assert chat.messages[1].reasoning_content == "I thought."
    forged = {"type": "thinking", "thinking": "", "signature": ReasoningSeal.generated().seal("Other.")}
    with pytest.raises(InvalidRequest) as refused:
        chat_request(body(forged), reasoning=True, open_signature=seal.open)
    assert refused.value.param == "messages.1.content.0.signature"
    # A block that carries its text is taken as it is, whatever its signature.
    shown = {"type": "thinking", "thinking": "Shown.", "signature": "not ours"}
    assert chat_request(body(shown), reasoning=True, open_signature=seal.open).messages[
        1
    ].reasoning_content == ("Shown.")


def test_claude_codes_fields_are_accepted() -> None:
    body = _body(
        max_tokens=32000,
        messages=[{"role": "user", "content": "x"}],
        metadata={"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "s" * 36})},
        thinking={"type": "adaptive", "display": "omitted"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
    )
    chat = chat_request(body, reasoning=False)
    assert chat.max_tokens == 32000 and chat.response_format is None
    for display in ("summarized", "highlights", "updates"):  # "updates": claude -p with stream-json
        _body(messages=[{"role": "user", "content": "x"}], thinking={"type": "adaptive", "display": display})
    with pytest.raises(pydantic.ValidationError, match=r"output_config\.effort"):
        _body(messages=[{"role": "user", "content": "x"}], output_config={"effort": "extreme"})
