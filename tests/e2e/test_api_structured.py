"""Structured outputs over HTTP against a real server (tiny random Llama, real engine core): JSON
schemas, json_object, regex, choice and grammars through response_format, structured_outputs and
the older guided_* fields, on chat and completions, streamed and not; invalid specs are 400s naming
the problem; with a reasoning parser the constraint applies to the answer, not to the reasoning.

Random weights give garbage, but garbage that must still match the constraint: that is the point.
They are also fond of whitespace, which JSON allows between any two tokens; the requests ban
whitespace-only tokens with logit_bias so outputs stay short (the grammar still does the work).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from izh.config import EngineConfig
from izh.tokenizer import load_tokenizer
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 256

# Nested objects, arrays, enums, required fields, numeric ranges, string patterns and lengths.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "floor": {"type": "integer", "minimum": -2, "maximum": 30},
            },
            "required": ["zip", "floor"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "active", "address", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{2,3}"
CHOICES = ["yes", "no", "maybe so"]
LARK_GRAMMAR = 'start: sum\nsum: NUMBER ("+" NUMBER){0,3}\nNUMBER: /[1-9][0-9]{0,2}/\n'
GBNF_GRAMMAR = 'root ::= "x=" [0-9] [0-9]? ";"'
SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 1234}, id="seeded"),
]
# Chat template with Qwen3's switch: thinking opens a <think> block, enable_thinking=false closes it.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def _config(model: str, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "model": model,
        "served_model_name": MODEL,
        "device": "cpu",
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": 1 << 23,
    }
    return EngineConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    with api_server(_config(tiny_llama_dir)) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def no_whitespace(tiny_llama_dir: str) -> dict[str, int]:
    """logit_bias banning every whitespace-only token of the tiny tokenizer."""
    tokenizer = load_tokenizer(tiny_llama_dir)
    banned = [
        token_id
        for token_id in range(tokenizer.vocab_size)
        if tokenizer.token_bytes(token_id) and not tokenizer.token_bytes(token_id).strip()
    ]
    assert banned
    return {str(token_id): -100 for token_id in banned}


def _messages(text: str = "Describe a person.") -> list[Any]:
    return [{"role": "user", "content": text}]


def _chat(client: openai.OpenAI, bias: dict[str, int], sampling: dict[str, Any], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=_messages(), max_tokens=MAX_TOKENS, logit_bias=bias, **sampling, **kwargs
    )


def _stream_chat(
    client: openai.OpenAI, bias: dict[str, int], sampling: dict[str, Any], **kwargs: Any
) -> tuple[str, str | None]:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=_messages(),
            max_tokens=MAX_TOKENS,
            logit_bias=bias,
            stream=True,
            **sampling,
            **kwargs,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    return text, finish[0]


# --- JSON schemas -------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_schema_output_validates_chat_and_stream(
    client: openai.OpenAI, no_whitespace: dict[str, int], sampling: dict[str, Any]
) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    reply = _chat(client, no_whitespace, sampling, response_format=response_format)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    text, finish = _stream_chat(client, no_whitespace, sampling, response_format=response_format)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    if sampling["temperature"] == 0.0:
        assert text == choice.message.content


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_schema_on_completions(
    client: openai.OpenAI, no_whitespace: dict[str, int], sampling: dict[str, Any]
) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="A person as JSON:",
        max_tokens=MAX_TOKENS,
        logit_bias=no_whitespace,
        n=2,
        extra_body={"structured_outputs": {"json": PERSON_SCHEMA}},
        **sampling,
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON_SCHEMA)


def test_guided_json_and_schema_as_text(client: openai.OpenAI, no_whitespace: dict[str, int]) -> None:
    small = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    for extra in ({"guided_json": small}, {"structured_outputs": {"json": json.dumps(small)}}):
        reply = _chat(client, no_whitespace, {"temperature": 0.0}, extra_body=extra)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), small)


def test_json_object_is_an_object(
    client: openai.OpenAI, no_whitespace: dict[str, int], tiny_llama_dir: str
) -> None:
    # An object's keys are unbounded strings that random weights may never close; with quotes
    # banned too, the one object left to write is {} (unconstrained, this model writes noise).
    tokenizer = load_tokenizer(tiny_llama_dir)
    no_quotes = {
        str(token_id): -100
        for token_id in range(tokenizer.vocab_size)
        if b'"' in tokenizer.token_bytes(token_id)
    }
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        reply = _chat(client, no_whitespace | no_quotes, sampling, response_format={"type": "json_object"})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == "{}"


def test_text_response_format_is_unconstrained(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=_messages(),
        max_tokens=4,
        temperature=0.0,
        response_format={"type": "text"},
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"


# --- regex, choice, grammar ------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_regex_matches_fully(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    for extra in ({"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}):
        reply = _chat(client, {}, sampling, extra_body=extra)
        assert reply.choices[0].finish_reason == "stop"
        assert re.fullmatch(REGEX, reply.choices[0].message.content or "")
    text, finish = _stream_chat(client, {}, sampling, extra_body={"guided_regex": REGEX})
    assert finish == "stop" and re.fullmatch(REGEX, text)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_choice_is_one_of_the_choices(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    for extra in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        reply = _chat(client, {}, sampling, extra_body=extra, n=3)
        for choice in reply.choices:
            assert choice.finish_reason == "stop" and choice.message.content in CHOICES
    completion = client.completions.create(
        model=MODEL, prompt="Well?", max_tokens=8, extra_body={"guided_choice": CHOICES}, **sampling
    )
    assert completion.choices[0].text in CHOICES


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_grammar_outputs_parse(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    reply = _chat(client, {}, sampling, extra_body={"structured_outputs": {"grammar": LARK_GRAMMAR}})
    text = reply.choices[0].message.content or ""
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}", text), text
    assert sum(int(term) for term in text.split("+")) > 0
    gbnf = _chat(client, {}, sampling, extra_body={"guided_grammar": GBNF_GRAMMAR})
    assert re.fullmatch(r"x=[0-9][0-9]?;", gbnf.choices[0].message.content or "")


# --- refusals -------------------------------------------------------------------------------------------


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _messages(), "max_tokens": 4, **fields}


def _refusal(server: ApiServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    reply = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def _schema_format(schema: Any) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        ({"response_format": _schema_format({"type": "objec"})}, "response_format", "Invalid type"),
        (
            {"response_format": _schema_format({"type": "object", "if": {}, "then": {}})},
            "response_format",
            "if",
        ),
        (
            {"response_format": _schema_format({"type": "string", "pattern": "(?=a)b"})},
            "response_format",
            "look-around",
        ),
        (
            {"response_format": _schema_format({"type": "string", "format": "color"})},
            "response_format",
            "format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"response_format": {"type": "regex"}}, "response_format", "regex"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"guided_regex": "[z-a]"}, "guided_regex", "regex"),
        ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs", "missing"),
        ({"guided_grammar": 'root ::= "a" undefined'}, "guided_grammar", "undefined"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex, choice"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "guided_regex",
            "response_format and guided_regex",
        ),
    ],
)
def test_invalid_specs_are_400s_naming_the_problem(
    server: ApiServer, fields: dict[str, Any], param: str, problem: str
) -> None:
    error = _refusal(server, _body(**fields))
    assert error["param"] == param and problem in error["message"], error


def test_completions_refuse_invalid_specs_too(server: ApiServer) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_json": {"type": "objec"}}
    error = _refusal(server, body, "/v1/completions")
    assert error["param"] == "guided_json" and "Invalid type" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


# --- reasoning --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    with api_server(_config(tiny_llama_dir), reasoning_parser="think") as started:
        yield started


def _thinking_chat(server: ApiServer, bias: dict[str, int], **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": _messages(),
        "max_tokens": 48,
        "temperature": 0.0,
        "logit_bias": bias,
        "chat_template": THINKING_TEMPLATE,
        "guided_json": PERSON_SCHEMA,
        **fields,
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    choice: dict[str, Any] = reply.json()["choices"][0]
    return choice


def test_enable_thinking_false_closes_the_think_block_and_constrains_the_answer(
    thinking_server: ApiServer, no_whitespace: dict[str, int]
) -> None:
    choice = _thinking_chat(
        thinking_server,
        no_whitespace,
        max_tokens=MAX_TOKENS,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] is None
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON_SCHEMA)


def test_schema_leaves_the_reasoning_free(thinking_server: ApiServer, no_whitespace: dict[str, int]) -> None:
    # The prompt opens <think>: the output is reasoning until </think>, which random weights do not
    # write in 48 tokens. Constraining the whole output would have forced JSON into the reasoning.
    choice = _thinking_chat(thinking_server, no_whitespace)
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] in (None, "")
    reasoning = choice["message"]["reasoning_content"]
    assert reasoning and not reasoning.startswith("{")


# --- the real model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_json_schema(smollm2_gguf: str) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0},
            "country": {"enum": ["France", "Germany", "Italy"]},
        },
        "required": ["city", "population", "country"],
        "additionalProperties": False,
    }
    config = _config(smollm2_gguf, max_model_len=512, kv_cache_memory_bytes=1 << 26)
    with (
        api_server(config) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="x", max_retries=0, timeout=600) as client,
    ):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
            max_tokens=96,
            temperature=0.0,
            response_format=_schema_format(schema),
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
