"""The OpenAI Python SDK's own helpers against a real `izh serve` of the default model: `parse` with a
strict pydantic function tool and with a pydantic response_format, and the `stream` helper.

These check the wire format the helpers rely on (strict schemas accepted, arguments and content that
parse into the model, a finish_reason that is not `length`, stream chunks the helper can accumulate),
not what SmolLM2-135M knows.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.real_server import API_KEY, RealServer, serve_default_model

pytestmark = pytest.mark.slow

PROMPT = "Extract the user from this text: Jason is 25 years old."


class User(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from serve_default_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: RealServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


def test_parse_with_a_required_pydantic_function_tool(client: openai.OpenAI, server: RealServer) -> None:
    completion = client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": PROMPT}],
        tools=[openai.pydantic_function_tool(User)],
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "User"
    assert isinstance(call.function.parsed_arguments, User), call.function


def test_parse_with_a_pydantic_response_format(client: openai.OpenAI, server: RealServer) -> None:
    completion = client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": PROMPT}],
        response_format=User,
        max_tokens=96,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, User), choice.message


def test_stream_helper_runs_to_completion(client: openai.OpenAI, server: RealServer) -> None:
    event_types: list[str] = []
    with client.chat.completions.stream(
        model=server.model,
        messages=[{"role": "user", "content": "Say hello."}],
        # Room to end on its own: get_final_completion raises LengthFinishReasonError on `length`.
        max_tokens=64,
        temperature=0,
        stream_options={"include_usage": True},
    ) as stream:
        for event in stream:
            event_types.append(event.type)
        completion = stream.get_final_completion()
    assert "chunk" in event_types and "content.delta" in event_types and "content.done" in event_types
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 64


def test_stream_helper_with_a_response_format_parses_the_content(
    client: openai.OpenAI, server: RealServer
) -> None:
    with client.chat.completions.stream(
        model=server.model,
        messages=[{"role": "user", "content": PROMPT}],
        response_format=User,
        max_tokens=96,
        temperature=0,
    ) as stream:
        done = [event for event in stream if event.type == "content.done"]
        completion = stream.get_final_completion()
    assert len(done) == 1 and isinstance(done[0].parsed, User), done
    assert isinstance(completion.choices[0].message.parsed, User)


def test_stream_helper_with_a_required_tool_parses_the_arguments(
    client: openai.OpenAI, server: RealServer
) -> None:
    # The helper accumulates tool-call deltas by index (id and name first, then argument fragments).
    with client.chat.completions.stream(
        model=server.model,
        messages=[{"role": "user", "content": PROMPT}],
        tools=[openai.pydantic_function_tool(User)],
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        completion = stream.get_final_completion()
    assert done and all(event.name == "User" for event in done), done
    assert all(isinstance(event.parsed_arguments, User) for event in done), done
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.id and isinstance(call.function.parsed_arguments, User)
