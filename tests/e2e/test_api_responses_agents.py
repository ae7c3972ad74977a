"""POST /v1/responses as coding agents call it (Codex CLI 0.171's first request, recorded and trimmed to
the tiny model's context), against a real server (tiny random Llama, real engine core), each leniency
checked with the openai SDK's strict validation or its stream event types:

reasoning.summary / reasoning.effort accepted (no reasoning item from a model without reasoning; the
reasoning text as the summary, with the reasoning_summary events, from a thinking template; effort
"none" turning thinking off where the template knows enable_thinking); include
reasoning.encrypted_content (sealed by the server, opened when it comes back with store false: the
same prompt as the reasoning sent in clear; altered, a 400); namespace tools flattened (a call names
its namespace); hosted tools skipped and named in x-izh-skipped-tools, or a 400 with
limits.strict_tools; custom (freeform) tools as custom_tool_call items and back, a custom tool with a
grammar skipped; prompt_cache_key, client_metadata, safety_identifier and service_tier accepted; a
call the model writes as bare JSON is a function_call item.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from izh.settings import LimitSettings
from tests.e2e.api_server import ApiServer, api_server
from tests.e2e.test_api_responses import MODEL, _config, _raw_events

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "cmd": {"type": "string", "description": "Shell command to execute."},
            "workdir": {"type": "string", "description": "Optional working directory."},
        },
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"target": {"enum": ["a1", "a2"]}},
                "required": ["target"],
                "additionalProperties": False,
            },
        }
    ],
}
# Codex 0.171's first request, its instructions and all but three of its tools left out.
CODEX_REQUEST: dict[str, Any] = {
    "model": MODEL,
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}],
    "tools": [EXEC_COMMAND, AGENTS, {"type": "web_search", "external_web_access": False}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a2422a-8857-71e1-9601-fe536c012a1e",
    "client_metadata": {"x-codex-window-id": "01a2422a-8857-71e1-9601-fe536c012a1e:0"},
    "max_output_tokens": 8,
    "temperature": 0,
}
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    with api_server(_config(tiny_llama_dir)) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with _client(server) as c:
        yield c


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    folder = tmp_path_factory.mktemp("thinking-agents") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config_path = Path(folder) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))
    with api_server(_config(str(folder)), reasoning_parser="think") as started:
        yield started


def _client(server: ApiServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )


def _post(server: ApiServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=300)


# --- Codex's request ----------------------------------------------------------------------------------------


def test_codex_first_request_is_served(server: ApiServer, client: openai.OpenAI) -> None:
    reply = _post(server, CODEX_REQUEST)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-izh-skipped-tools"] == "web_search"
    body = reply.json()
    assert [tool["type"] for tool in body["tools"]] == ["function", "namespace"]
    assert body["prompt_cache_key"] == CODEX_REQUEST["prompt_cache_key"]
    assert body["reasoning"] == {"summary": "auto"}
    # The tiny model has no reasoning: no reasoning item, and no error.
    assert all(item["type"] != "reasoning" for item in body["output"])
    fields = {key: value for key, value in CODEX_REQUEST.items() if key != "client_metadata"}
    extra = {"client_metadata": CODEX_REQUEST["client_metadata"]}
    response = client.responses.create(**fields, extra_body=extra)  # validated by the SDK
    assert response.status in ("completed", "incomplete")
    events = _raw_events(server, CODEX_REQUEST)
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_unknown_fields_openai_accepts(server: ApiServer) -> None:
    extra = {"safety_identifier": "u-1", "service_tier": "flex", "user": "me", "client_metadata": {"a": "b"}}
    reply = _post(server, {"input": "Hi", "max_output_tokens": 2, **extra})
    assert reply.status_code == 200, reply.text
    assert reply.json()["service_tier"] == "default" and reply.json()["safety_identifier"] == "u-1"


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh"])
@pytest.mark.parametrize("summary", ["auto", "concise", "detailed"])
def test_reasoning_settings_accepted_without_reasoning(server: ApiServer, effort: str, summary: str) -> None:
    reply = _post(
        server, {"input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": effort, "summary": summary}}
    )
    assert reply.status_code == 200, reply.text
    assert [item["type"] for item in reply.json()["output"]] == ["message"]


# --- tools ---------------------------------------------------------------------------------------------------


def test_namespace_call_names_its_namespace(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Close agent a1",
        tools=[AGENTS],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "close_agent"},
        max_output_tokens=200,
        temperature=0,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "close_agent" and json.loads(call.arguments)["target"] in ("a1", "a2")
    assert call.model_dump()["namespace"] == "multi_agent_v1"


def test_hosted_tools_skipped_or_refused(server: ApiServer, tiny_llama_dir: str) -> None:
    hosted = [
        {"type": kind} for kind in ("web_search", "file_search", "code_interpreter", "image_generation")
    ]
    reply = _post(server, {"input": "Hi", "max_output_tokens": 2, "tools": [EXEC_COMMAND, *hosted]})
    assert reply.status_code == 200, reply.text
    assert (
        reply.headers["x-izh-skipped-tools"] == "web_search, file_search, code_interpreter, image_generation"
    )
    assert reply.json()["tools"][0]["name"] == "exec_command"
    assert "x-izh-skipped-tools" not in _post(server, {"input": "Hi", "max_output_tokens": 2}).headers
    with api_server(_config(tiny_llama_dir), limits=LimitSettings(strict_tools=True)) as strict:
        refused = _post(strict, {"input": "Hi", "tools": [EXEC_COMMAND, *hosted]})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "tools.1.type" and "web_search" in error["message"]
        assert (
            _post(strict, {"input": "Hi", "max_output_tokens": 2, "tools": [EXEC_COMMAND]}).status_code == 200
        )


def test_custom_tool_round_trip(server: ApiServer) -> None:
    patch_tool = {"type": "custom", "name": "apply_patch", "description": "Apply a patch, as free text."}
    grammar_tool = {
        "type": "custom",
        "name": "calc",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9+]+"},
    }
    body = {
        "input": "Patch it",
        "tools": [patch_tool, grammar_tool],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    reply = _post(server, body)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-izh-skipped-tools"] == "custom:calc"
    (call,) = [item for item in reply.json()["output"] if item["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and isinstance(call["input"], str)
    streamed = [e for e in _raw_events(server, body) if e.type == "response.output_item.done"]
    assert [e.item.type for e in streamed] == ["custom_tool_call"]
    back = {
        "input": [
            {"role": "user", "content": "Patch it"},
            {
                "type": "custom_tool_call",
                "call_id": call["call_id"],
                "name": "apply_patch",
                "input": call["input"],
            },
            {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done!"},
        ],
        "tools": [patch_tool],
        "max_output_tokens": 2,
    }
    assert _post(server, back).status_code == 200


def test_bare_json_call_is_a_function_call(server: ApiServer) -> None:
    # The schema makes the random model write what Qwen2.5 writes without its tags: a bare call object.
    call_schema = {
        "type": "object",
        "properties": {
            "name": {"const": "exec_command"},
            "arguments": {
                "type": "object",
                "properties": {"cmd": {"enum": ["python3 hello.py"]}},
                "required": ["cmd"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    body = {
        "input": "Run hello.py",
        "tools": [EXEC_COMMAND],
        "text": {"format": {"type": "json_schema", "name": "call", "schema": call_schema}},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    reply = _post(server, body)
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert len(output) == 1, output
    item = output[0]
    assert item["type"] == "function_call" and item["name"] == "exec_command"
    assert json.loads(item["arguments"]) == {"cmd": "python3 hello.py"}
    events = _raw_events(server, body)
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == {"cmd": "python3 hello.py"}


# --- reasoning -----------------------------------------------------------------------------------------------


def test_reasoning_summary_and_sealed_reasoning(thinking_server: ApiServer) -> None:
    body = {
        "input": "Think",
        "max_output_tokens": 12,
        "temperature": 0,
        "reasoning": {"summary": "detailed", "effort": "high"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
    }
    with _client(thinking_server) as client:
        response = client.responses.create(model=MODEL, **body)
    (item,) = response.output
    assert item.type == "reasoning" and item.content is not None
    text = item.content[0].text
    assert text and [part.text for part in item.summary] == [text]
    assert item.encrypted_content and text not in item.encrypted_content
    events = _raw_events(thinking_server, body)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_summary_text.done"]
    assert deltas == done.text == text
    kinds = [e.type for e in events if e.type.startswith("response.reasoning_summary_part")]
    assert kinds == ["response.reasoning_summary_part.added", "response.reasoning_summary_part.done"]

    # Sent back sealed (store false), it is the same prompt as the reasoning sent in clear.
    history = [{"role": "user", "content": "Think"}]
    sealed = {"type": "reasoning", "summary": [], "encrypted_content": item.encrypted_content}
    clear = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    follow = [{"role": "user", "content": "And?"}]
    usages = []
    for reasoning in (sealed, clear):
        reply = _post(thinking_server, {"input": [*history, reasoning, *follow], "max_output_tokens": 1})
        assert reply.status_code == 200, reply.text
        usages.append(reply.json()["usage"]["input_tokens"])
    assert usages[0] == usages[1]
    token = item.encrypted_content
    tampered = token[:20] + ("A" if token[20] != "A" else "B") + token[21:]
    reply = _post(thinking_server, {"input": [*history, {**sealed, "encrypted_content": tampered}, *follow]})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "input.1.encrypted_content"


def test_effort_none_turns_thinking_off(thinking_server: ApiServer) -> None:
    body = {"input": "Think", "max_output_tokens": 6, "temperature": 0}
    thinking = _post(thinking_server, {**body, "reasoning": {"effort": "high"}}).json()
    quiet = _post(thinking_server, {**body, "reasoning": {"effort": "none"}}).json()
    assert [item["type"] for item in thinking["output"]] == ["reasoning"]
    assert "reasoning" not in [item["type"] for item in quiet["output"]]
    assert quiet["usage"]["input_tokens"] > thinking["usage"]["input_tokens"]  # the closed think block
