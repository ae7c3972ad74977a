"""instructor, LangChain and pydantic-ai against a real `izh serve` of the default model, over chat
completions and (LangChain's use_responses_api, pydantic-ai's OpenAIResponsesModel) the Responses API.

Each library drives the OpenAI wire format its own way (instructor's named tool_choice and bare
json_schema, LangChain's bind_tools / with_structured_output, pydantic-ai's tool_choice "required" and
tool-result turns); the tests check that what izh answers parses into the library's objects and that
forced calls and structured output end on their own, not what SmolLM2-135M knows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, SecretStr

from tests.e2e.real_server import API_KEY, RealServer, serve_default_model

pytestmark = pytest.mark.slow

PROMPT = "Extract the user from this text: Jason is 25 years old."
WEATHER = "sunny, 21 C"
# Room for a forced call or a small JSON object to close on its own; `length` fails the test.
MAX_TOKENS = 96


class User(BaseModel):
    """A user."""

    name: str
    age: int


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from serve_default_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: RealServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


# --- instructor ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode_name", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_pydantic_model(
    client: openai.OpenAI, server: RealServer, mode_name: str
) -> None:
    import instructor

    # TOOLS sends a named tool_choice; JSON_SCHEMA a response_format json_schema without "strict".
    extractor = instructor.from_openai(client, mode=getattr(instructor.Mode, mode_name))
    user = extractor.chat.completions.create(
        model=server.model,
        response_model=User,
        messages=[{"role": "user", "content": PROMPT}],
        max_retries=0,  # one request: a retry would hide a reply that did not parse
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(user, User)


# --- LangChain ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server: RealServer) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.base_url,
        api_key=SecretStr(API_KEY),
        model=server.model,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        timeout=300,
    )


def test_langchain_bind_tools_round_trip(chat_model: Any) -> None:
    from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return WEATHER

    messages: list[BaseMessage] = [HumanMessage("What is the weather in Oslo?")]
    called = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert isinstance(called, AIMessage)
    assert called.response_metadata["finish_reason"] == "tool_calls", called
    assert called.tool_calls and all(call["name"] == "get_weather" for call in called.tool_calls)
    assert not called.invalid_tool_calls, called.invalid_tool_calls
    messages.append(called)
    for call in called.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))

    answer = chat_model.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert isinstance(answer, AIMessage) and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] == "stop", answer
    assert isinstance(answer.content, str) and answer.content.strip()


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(chat_model: Any, method: str) -> None:
    structured = chat_model.with_structured_output(User, method=method)
    assert isinstance(structured.invoke(PROMPT), User)


# --- pydantic-ai --------------------------------------------------------------------------------------


def test_pydantic_ai_agent_calls_its_tool_and_answers(server: RealServer) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAIProvider(base_url=server.base_url, api_key=API_KEY)
    model = OpenAIChatModel(server.model, provider=provider)

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # SmolLM2-135M does not call tools on its own: force the tool on the first step (pydantic-ai's
        # documented per-step tool_choice), then let it answer in text.
        tool_choice: Any = ["get_weather"] if ctx.run_step <= 1 else "none"
        return {"max_tokens": MAX_TOKENS, "temperature": 0.0, "tool_choice": tool_choice}

    agent = Agent(model, model_settings=settings, instructions="Answer with the weather tool's result.")
    cities: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return WEATHER

    result = agent.run_sync("What is the weather in Oslo?")
    assert cities, "the agent never called its tool"
    assert isinstance(result.output, str) and result.output.strip()
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    calling = [r for r in responses if any(isinstance(p, ToolCallPart) for p in r.parts)]
    assert calling and all(r.finish_reason == "tool_call" for r in calling), calling
    assert responses[-1].finish_reason == "stop", responses[-1]


# --- over the Responses API ------------------------------------------------------------------------------


def test_langchain_over_the_responses_api(server: RealServer) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        base_url=server.base_url,
        api_key=SecretStr(API_KEY),
        model=server.model,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        timeout=300,
        use_responses_api=True,
    )
    answer = model.invoke("Say hello.")
    assert isinstance(answer, AIMessage) and answer.text.strip()
    assert "".join(chunk.text for chunk in model.stream("Say hello.")).strip()
    assert isinstance(model.with_structured_output(User, method="json_schema").invoke(PROMPT), User)


def test_pydantic_ai_responses_agent_calls_its_tool_and_answers(server: RealServer) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAIProvider(base_url=server.base_url, api_key=API_KEY)
    model = OpenAIResponsesModel(server.model, provider=provider)

    def settings(ctx: RunContext[None]) -> ModelSettings:
        # As over chat: force the tool on the first step, then let it answer in text.
        tool_choice: Any = "required" if ctx.run_step <= 1 else "none"
        return {"max_tokens": MAX_TOKENS, "temperature": 0.0, "tool_choice": tool_choice}

    agent = Agent(model, model_settings=settings, instructions="Answer with the weather tool's result.")
    cities: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return WEATHER

    result = agent.run_sync("What is the weather in Oslo?")
    assert cities, "the agent never called its tool"
    assert isinstance(result.output, str) and result.output.strip()
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert any(isinstance(p, ToolCallPart) for r in responses for p in r.parts)
    assert responses[-1].finish_reason == "stop", responses[-1]
