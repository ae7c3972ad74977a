"""The Responses API's pieces without a server: input items → chat messages (and 400s naming the item),
the output builder's items and typed events over chat's real parsers (reasoning, text, a Hermes tool
call), validated with the openai SDK's own types, and the store's LRU bound and key scoping."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from izh.api.chat.choices import ChatContext
from izh.api.common.fanout import UsageCounter
from izh.api.responses.items import items_to_messages, normalize_input
from izh.api.responses.protocol import ResponseObject
from izh.api.responses.store import ResponseStore, StoredResponse
from izh.api.responses.stream import OutputBuilder, ResponseContext
from izh.errors import EngineDead, InvalidRequest
from izh.frontend.output_processor import RequestOutput
from izh.parsers.hermes import HermesToolParser

EVENTS = TypeAdapter(ResponseStreamEvent)


def _messages(value: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in items_to_messages(normalize_input(value))]


def test_a_string_is_one_user_message() -> None:
    (item,) = normalize_input("Hi")
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]
    assert _messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_a_tool_round_trip_becomes_chats_history() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {
            "type": "function_call",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call", "call_id": "call_b", "name": "now", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "12:00"}],
        },
        {"role": "developer", "content": "Be brief."},
    ]
    messages = _messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "developer"]
    turn = messages[1]
    assert turn["content"] == "Checking." and turn["reasoning_content"] == "hmm"
    assert [(c["id"], c["function"]["name"]) for c in turn["tool_calls"]] == [
        ("call_a", "get_weather"),
        ("call_b", "now"),
    ]
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_a"}
    assert messages[3]["content"] == "12:00"


def test_reasoning_without_an_answer_is_an_assistant_turn_of_its_own() -> None:
    items = [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}]},
        {"role": "user", "content": "b"},
    ]
    messages = _messages(items)
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "thought"}


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input.0.content.0.type"),
        ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "input.0.content.0.type"),
        ({"role": "user", "content": 3}, "input.0.content"),
        ({"role": "critic", "content": "x"}, "input.0.role"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input.0.arguments"),
        ({"type": "reasoning", "summary": [], "encrypted_content": "xyz"}, "input.0.encrypted_content"),
        ({"type": "computer_call_output", "call_id": "c"}, "input.0.type"),
    ],
)
def test_refused_items_are_named(item: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        normalize_input([item])
    assert refused.value.param == param


# --- the output builder ------------------------------------------------------------------------------------


def _context(final: list[ResponseObject]) -> ResponseContext:
    chat = ChatContext(
        id="resp_x",
        created=0,
        model="m",
        parser_name="think",
        starts_in_reasoning=True,
        echo_text=None,
        top_logprobs=None,
        include_usage=False,
        continuous_usage=False,
        tool_parser=HermesToolParser,
    )
    base = ResponseObject(id="resp_x", created_at=0, status="in_progress", model="m")
    return ResponseContext(base=base, chat=chat, top_logprobs=None, request_id="r", on_final=final.append)


def _outputs(pieces: list[str], finish_reason: str = "stop") -> list[RequestOutput]:
    return [
        RequestOutput(
            request_id="r",
            text=piece,
            token_ids=[7],
            finished=index == len(pieces) - 1,
            finish_reason=finish_reason if index == len(pieces) - 1 else None,
            num_prompt_tokens=5,
            num_output_tokens=index + 1,
        )
        for index, piece in enumerate(pieces)
    ]


PIECES = [
    "Let me ",
    "think.",
    "</think>",
    "\n\nSure: ",
    "calling.",
    '<tool_call>\n{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>',
]


def _build(emit: bool, pieces: list[str] = PIECES) -> tuple[OutputBuilder, list[ResponseObject]]:
    final: list[ResponseObject] = []
    builder = OutputBuilder(_context(final), emit=emit)
    builder.start()
    usage = UsageCounter()
    for out in _outputs(pieces):
        usage.add(_Child(), out)  # type: ignore[arg-type]
        builder.feed(out)
    builder.finish(usage)
    return builder, final


class _Child:
    index = prompt_index = sample_index = 0


def test_reasoning_text_and_a_call_are_three_items_and_openais_events() -> None:
    builder, (final,) = _build(emit=True)
    response = Response.model_validate(final.model_dump())
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = response.output
    assert reasoning.content and reasoning.content[0].text == "Let me think."  # type: ignore[union-attr]
    assert message.content[0].text == "Sure: calling."  # type: ignore[union-attr]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert response.status == "completed" and response.usage is not None
    # The tokens up to and including </think> are reasoning.
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    events = []
    for block in builder.take_events().decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = EVENTS.validate_python(json.loads(data.removeprefix("data: ")))
            assert name == f"event: {event.type}"
            events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events if not e.type.endswith(".delta")]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments  # type: ignore[union-attr]


def test_collecting_builds_the_same_items_without_events() -> None:
    _, (streamed_final,) = _build(emit=True)
    collected, (collected_final,) = _build(emit=False)
    assert collected.take_events() == b""

    def shape(response: ResponseObject) -> list[Any]:
        return [
            {k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}
            for item in response.output
        ]

    assert shape(streamed_final) == shape(collected_final)


def test_cut_off_output_is_incomplete() -> None:
    final: list[ResponseObject] = []
    builder = OutputBuilder(_context(final), emit=False)
    usage = UsageCounter()
    for out in _outputs(["still ", "thinking"], finish_reason="length"):
        usage.add(_Child(), out)  # type: ignore[arg-type]
        builder.feed(out)
    response = builder.finish(usage)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.output[0].status == "incomplete"


def test_an_engine_failure_is_a_failed_response() -> None:
    final: list[ResponseObject] = []
    builder = OutputBuilder(_context(final), emit=True)
    builder.start()
    usage = UsageCounter()
    (out,) = _outputs(["partial"])
    out.finished, out.finish_reason = False, None
    usage.add(_Child(), out)  # type: ignore[arg-type]
    builder.feed(out)
    response = builder.finish(usage, EngineDead("the engine core is dead: killed"))
    assert final == [response]
    assert response.status == "failed" and response.error is not None
    assert response.error.code == "server_error" and "killed" in response.error.message
    last = builder.take_events().decode().rstrip("\n").split("\n\n")[-1]
    event = EVENTS.validate_python(json.loads(last.split("\n")[1].removeprefix("data: ")))
    assert event.type == "response.failed" and event.response.output[0].status == "incomplete"


# --- the store -----------------------------------------------------------------------------------------------


def _stored(response_id: str) -> StoredResponse:
    response = ResponseObject(id=response_id, created_at=0, status="completed", model="m")
    return StoredResponse(response, [], [])


def test_the_store_is_lru_bounded_and_scoped_by_key() -> None:
    store = ResponseStore(2)
    store.put("a", _stored("r1"))
    store.put("a", _stored("r2"))
    assert store.get("b", "r1") is None
    assert store.get("a", "r1") is not None  # r1 is now the most recently used
    store.put("a", _stored("r3"))
    assert len(store) == 2 and store.get("a", "r2") is None and store.get("a", "r1") is not None
    assert store.delete("a", "r1") and not store.delete("a", "r1")
    empty = ResponseStore(0)
    empty.put("a", _stored("r1"))
    assert len(empty) == 0
