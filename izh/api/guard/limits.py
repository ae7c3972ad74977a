"""Bounds on what one request may ask for, checked on the raw JSON before any route or model runs.

The request guard reads the body (bounded in bytes and time), parses it once (`parse_json`: with
the parser of pydantic's JSON mode, so that the route can validate the same value), refuses a body
nested deeper than `max_json_depth` before walking it further, then checks the counts and sizes below
(each a `[limits]` setting). Every refusal is a 400 `limit_exceeded` whose
message names the setting and whose `param` is the offending field. Values of the wrong type are left
alone: the route's own validation names those.

A body that is not JSON at all passes through untouched: the route refuses it with its usual message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pydantic_core

from izh.errors import InvalidRequest, LimitExceeded
from izh.settings import LimitSettings

NOT_JSON = object()
"""What `load_json` returns for a body the JSON parser refuses."""


def load_json(body: bytes, max_depth: int) -> Any:
    """The parsed body, or NOT_JSON; LimitExceeded when nested deeper than `max_depth`."""
    try:
        data = json.loads(body)
    except RecursionError:
        # The C parser gives up on absurd nesting by itself, long before reading the whole body.
        raise _too_deep(None, max_depth) from None
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an int with too many digits
        return NOT_JSON
    if json_depth(data, max_depth) > max_depth:
        raise _too_deep(None, max_depth)
    return data


def parse_json(body: bytes, max_depth: int) -> tuple[Any, bool]:
    """(the parsed body or NOT_JSON, whether pydantic's JSON mode reads the body as this value).

    pydantic's own JSON parser comes first: a route may validate its value with `model_validate`
    and get exactly what `model_validate_json` of the bytes would give. What that parser refuses (not
    JSON, a lone surrogate, UTF-16, nesting past its recursion limit) goes through `load_json` as
    ever, for the same verdict as before; the route then parses the bytes itself.
    """
    try:
        data = pydantic_core.from_json(body)
    except (ValueError, RecursionError):
        return load_json(body, max_depth), False
    if json_depth(data, max_depth) > max_depth:
        raise _too_deep(None, max_depth)
    return data, True


def json_depth(value: Any, stop_above: int) -> int:
    """The nesting depth of a JSON value (a scalar is 0, `[]` is 1); stops counting past `stop_above`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > stop_above:
                return deepest
        stack.extend((child, depth) for child in children if isinstance(child, dict | list))
    return deepest


def _too_deep(param: str | None, max_depth: int, what: str = "the request body") -> LimitExceeded:
    setting = "max_json_depth" if param is None else "max_schema_depth"
    return LimitExceeded(
        f"{what} is nested deeper than the limit of {max_depth} (limits.{setting})", param=param
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The `[limits]` settings, plus what the model adds: its context and its template names."""

    settings: LimitSettings
    max_model_len: int
    template_names: frozenset[str] = frozenset()

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt (or /detokenize input): the setting, at most the model's context."""
        return min(self.settings.max_prompt_tokens or self.max_model_len, self.max_model_len)

    def checker(self, path: str) -> Callable[[dict[str, Any]], None] | None:
        """The check for a route's body (None: the route takes no JSON body we bound)."""
        return {
            "/v1/chat/completions": self.check_chat,
            "/v1/completions": self.check_completion,
            "/v1/responses": self.check_responses,
            "/v1/messages": self.check_anthropic_messages,
            "/v1/messages/count_tokens": self.check_anthropic_messages,
            "/tokenize": self.check_tokenize,
            "/detokenize": self.check_detokenize,
            "/v1/embeddings": self.check_embeddings,
            "/v1/rerank": self.check_scoring,
            "/rerank": self.check_scoring,
            "/score": self.check_scoring,
            "/v1/score": self.check_scoring,
        }.get(path)

    # --- per route ---------------------------------------------------------------------------------

    def check_chat(self, body: dict[str, Any]) -> None:
        self._check_messages(body)
        self._check_sampling(body)
        self._at_most(
            "top_logprobs", body.get("top_logprobs"), self.settings.max_top_logprobs, "max_top_logprobs"
        )
        self._check_tools(body)
        self._check_chat_template(body)

    def check_completion(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(_is_int(item) for item in prompt):
            self._count("prompt", prompt, self.settings.max_prompts, "max_prompts", "prompts")
        self._check_sampling(body)
        self._at_most("logprobs", body.get("logprobs"), self.settings.max_top_logprobs, "max_top_logprobs")

    def check_responses(self, body: dict[str, Any]) -> None:
        """The Responses API's fields under chat's limits: input items count as messages."""
        s = self.settings
        items = body.get("input")
        if isinstance(items, list):
            self._count("input", items, s.max_messages, "max_messages", "input items")
        if s.max_output_tokens is not None:
            self._at_most(
                "max_output_tokens", body.get("max_output_tokens"), s.max_output_tokens, "max_output_tokens"
            )
        self._at_most("top_logprobs", body.get("top_logprobs"), s.max_top_logprobs, "max_top_logprobs")
        tools = body.get("tools")
        if isinstance(tools, list):
            self._count("tools", tools, s.max_tools, "max_tools", "tools")
            for index, tool in enumerate(tools):
                if isinstance(tool, dict):
                    self._check_schema(f"tools.{index}.parameters", tool.get("parameters"))
        text = body.get("text")
        if isinstance(text, dict) and isinstance(text.get("format"), dict):
            self._check_schema("text.format", text["format"].get("schema"))

    def check_anthropic_messages(self, body: dict[str, Any]) -> None:
        """Anthropic's Messages fields under chat's limits (input_schema is a tool's parameters)."""
        s = self.settings
        self._check_messages(body)
        if s.max_output_tokens is not None:
            self._at_most("max_tokens", body.get("max_tokens"), s.max_output_tokens, "max_output_tokens")
        self._check_stop(body.get("stop_sequences"), "stop_sequences")
        tools = body.get("tools")
        if isinstance(tools, list):
            self._count("tools", tools, s.max_tools, "max_tools", "tools")
            for index, tool in enumerate(tools):
                if isinstance(tool, dict):
                    self._check_schema(f"tools.{index}.input_schema", tool.get("input_schema"))

    def check_embeddings(self, body: dict[str, Any]) -> None:
        """The number of inputs (tokens per input: limits.max_prompt_tokens, checked once tokenized)."""
        inputs = body.get("input")
        if isinstance(inputs, list) and inputs and not all(_is_int(item) for item in inputs):
            self._count("input", inputs, self.settings.max_embedding_inputs, "max_embedding_inputs", "inputs")

    def check_scoring(self, body: dict[str, Any]) -> None:
        """Rerank's documents and score's texts count as embedding inputs."""
        for field in ("documents", "text_1", "text_2"):
            texts = body.get(field)
            if isinstance(texts, list):
                self._count(field, texts, self.settings.max_embedding_inputs, "max_embedding_inputs", "texts")

    def check_tokenize(self, body: dict[str, Any]) -> None:
        self._check_messages(body)
        self._check_tools(body)
        self._check_chat_template(body)

    def check_detokenize(self, body: dict[str, Any]) -> None:
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > self.max_prompt_tokens:
            raise LimitExceeded(
                f"tokens: {len(tokens)} tokens exceed the limit of {self.max_prompt_tokens} "
                "(limits.max_prompt_tokens, at most the model's context length)",
                param="tokens",
            )

    # --- field groups --------------------------------------------------------------------------------

    def _check_messages(self, body: dict[str, Any]) -> None:
        messages = body.get("messages")
        if isinstance(messages, list):
            self._count("messages", messages, self.settings.max_messages, "max_messages", "messages")

    def _check_sampling(self, body: dict[str, Any]) -> None:
        s = self.settings
        self._at_most("n", body.get("n"), s.max_n, "max_n")
        if s.max_output_tokens is not None:  # else the route's context-length check says it better
            for name in ("max_tokens", "max_completion_tokens"):
                self._at_most(name, body.get(name), s.max_output_tokens, "max_output_tokens")
        self._at_most("prompt_logprobs", body.get("prompt_logprobs"), s.max_top_logprobs, "max_top_logprobs")
        self._check_stop(body.get("stop"))
        stop_token_ids = body.get("stop_token_ids")
        if isinstance(stop_token_ids, list):
            self._count("stop_token_ids", stop_token_ids, s.max_stop_token_ids, "max_stop_token_ids", "ids")
        logit_bias = body.get("logit_bias")
        if isinstance(logit_bias, dict):
            self._count("logit_bias", logit_bias, s.max_logit_bias, "max_logit_bias", "entries")
        self._check_constraints(body)

    def _check_stop(self, stop: Any, param: str = "stop") -> None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            return
        self._count(param, stops, self.settings.max_stop, "max_stop", "stop strings")
        for item in stops:
            if isinstance(item, str) and len(item) > self.settings.max_stop_chars:
                raise LimitExceeded(
                    f"{param}: a stop string of {len(item)} characters exceeds the limit of "
                    f"{self.settings.max_stop_chars} (limits.max_stop_chars)",
                    param=param,
                )

    def _check_constraints(self, body: dict[str, Any]) -> None:
        self._check_schema("guided_json", body.get("guided_json"))
        self._check_text("guided_regex", body.get("guided_regex"), "max_regex_chars")
        self._check_text("guided_grammar", body.get("guided_grammar"), "max_grammar_chars")
        self._check_choice("guided_choice", body.get("guided_choice"))
        structured = body.get("structured_outputs")
        if isinstance(structured, dict):
            param = "structured_outputs"
            self._check_schema(param, structured.get("json"))
            self._check_text(param, structured.get("regex"), "max_regex_chars")
            self._check_text(param, structured.get("grammar"), "max_grammar_chars")
            self._check_choice(param, structured.get("choice"))
        response_format = body.get("response_format")
        if isinstance(response_format, dict):
            self._check_schema("response_format", response_format.get("schema"))
            json_schema = response_format.get("json_schema")
            if isinstance(json_schema, dict):
                self._check_schema("response_format", json_schema.get("schema"))

    def _check_tools(self, body: dict[str, Any]) -> None:
        tools = body.get("tools")
        if not isinstance(tools, list):
            return
        self._count("tools", tools, self.settings.max_tools, "max_tools", "tools")
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict):
                self._check_schema(f"tools.{index}.function.parameters", function.get("parameters"))

    def _check_chat_template(self, body: dict[str, Any]) -> None:
        template = body.get("chat_template")
        if not isinstance(template, str) or template in self.template_names:
            return  # the model's own template, by name, is always allowed
        if not self.settings.trust_request_chat_template:
            raise InvalidRequest(
                "chat_template: this server does not accept chat templates in requests "
                "(limits.trust_request_chat_template is off); name one of the model's templates"
                + (f" ({', '.join(sorted(self.template_names))})" if self.template_names else "")
                + " or leave it out",
                param="chat_template",
                code="chat_template_not_allowed",
            )
        self._check_text("chat_template", template, "max_chat_template_chars")

    # --- primitives ----------------------------------------------------------------------------------

    def _at_most(self, param: str, value: Any, limit: int, setting: str) -> None:
        if _is_int(value) and value > limit:
            raise LimitExceeded(
                f"{param}: {value} exceeds the limit of {limit} (limits.{setting})", param=param
            )

    def _count(
        self, param: str, items: list[Any] | dict[str, Any], limit: int, setting: str, noun: str
    ) -> None:
        if len(items) > limit:
            raise LimitExceeded(
                f"{param}: {len(items)} {noun} exceed the limit of {limit} (limits.{setting})", param=param
            )

    def _check_text(self, param: str, text: Any, setting: str) -> None:
        limit = getattr(self.settings, setting)
        if isinstance(text, str) and len(text) > limit:
            raise LimitExceeded(
                f"{param}: {len(text)} characters exceed the limit of {limit} (limits.{setting})", param=param
            )

    def _check_choice(self, param: str, choice: Any) -> None:
        if isinstance(choice, list):
            self._check_size(param, choice, "the choice list")

    def _check_schema(self, param: str, schema: Any) -> None:
        """A JSON schema (an object, or its JSON text): bounded in size and depth."""
        if isinstance(schema, str):
            self._check_size(param, schema, "the schema")
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise _too_deep(param, self.settings.max_schema_depth, f"{param}: the schema") from None
            except ValueError:
                return  # the route says what is wrong with it
        if not isinstance(schema, dict | list):
            return
        self._check_size(param, schema, "the schema")
        max_depth = self.settings.max_schema_depth
        if json_depth(schema, max_depth) > max_depth:
            raise _too_deep(param, max_depth, f"{param}: the schema")

    def _check_size(self, param: str, value: Any, what: str) -> None:
        limit = self.settings.max_schema_bytes
        size = len(value.encode()) if isinstance(value, str) else len(json.dumps(value).encode())
        if size > limit:
            raise LimitExceeded(
                f"{param}: {what} is {size} bytes of JSON, over the limit of {limit} (limits.max_schema_bytes)",
                param=param,
            )
