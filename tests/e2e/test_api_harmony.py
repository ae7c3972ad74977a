"""gpt-oss's harmony format over HTTP against a real server (tiny random Llama, real engine core) served
with a harmony chat template (`--chat-template`), so `auto` picks the harmony reasoning and tool-call
parsers: a regex makes the random model write what gpt-oss writes (an analysis message, then a call to
functions.get_weather or a final answer), and chat completions return reasoning_content, tool_calls
and content (no marker left in it); streamed deltas add up to the non-streamed message. (The Messages
and Responses routes feed the same ChoiceParsers.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server
from tests.e2e.test_api_tools import MAX_MODEL_LEN, MODEL, TOOLS, _streamed_calls

# gpt-oss's prompt layout, reduced: messages as harmony messages, the tools as a developer message,
# and the generation prompt `<|start|>assistant` (the markers are plain text in this tokenizer).
TEMPLATE = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{%- endif %}"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
    "{#- tool calls: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> -#}"
)
ANALYSIS = "<|channel|>analysis<|message|>The user asks about the weather. Call get_weather.<|end|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
CALL_ARGUMENTS = r'\{"city": "(Paris|Oslo)", "days": [1-7]\}'
FINAL_HEADER = "<|start|>assistant<|channel|>final<|message|>"
FINAL_TEXT = r"It is sunny in (Paris|Oslo)\."
_REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|-")


def _literal(text: str) -> str:
    """`text` as a literal inside a regex."""
    return "".join(f"\\{char}" if char in _REGEX_SPECIAL else char for char in text)


CALL_REGEX = _literal(ANALYSIS + CALL_HEADER) + CALL_ARGUMENTS
FINAL_REGEX = _literal(ANALYSIS + FINAL_HEADER) + FINAL_TEXT


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 23,
    )
    with api_server(config, chat_template=TEMPLATE) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _create(client: openai.OpenAI, regex: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        max_tokens=300,
        temperature=0.0,
        extra_body={"guided_regex": regex},
        **kwargs,
    )


def test_a_harmony_call_is_reasoning_and_a_tool_call(client: openai.OpenAI) -> None:
    regex = CALL_REGEX
    reply = _create(client, regex)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    message = choice.message
    assert message.model_extra["reasoning_content"] == "The user asks about the weather. Call get_weather."
    assert not message.content
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7

    chunks = list(_create(client, regex, stream=True))
    content, calls, finish = _streamed_calls(chunks)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert (content, finish) == ("", ["tool_calls"])
    assert reasoning == message.model_extra["reasoning_content"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_a_harmony_answer_is_reasoning_and_content(client: openai.OpenAI) -> None:
    regex = FINAL_REGEX
    message = _create(client, regex).choices[0].message
    assert message.model_extra["reasoning_content"].startswith("The user asks")
    assert re.fullmatch(r"It is sunny in (Paris|Oslo)\.", message.content) and not message.tool_calls
    assert "<|" not in message.content
    chunks = list(_create(client, regex, stream=True))
    content, calls, finish = _streamed_calls(chunks)
    assert (content, calls, finish) == (message.content, {}, ["stop"])
