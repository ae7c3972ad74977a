"""Output constraints: response_format, structured_outputs, guided_* and forced tool calls → the
request's one grammar spec, checked enforceable, and applied to the answer only when a reasoning
parser leaves the think block free.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from izh.api.common.chat_protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
)
from izh.api.common.protocol import (
    ResponseFormat,
    SamplingFields,
    StructuredOutputsRequest,
)
from izh.api.common.state import ApiState
from izh.errors import InvalidRequest
from izh.guided_spec import (
    build_ll_tokenizer,
    json_compile_options,
    lark_literal,
    lark_opaque_end,
    validate_spec,
)
from izh.parsers.reasoning import THINK_END
from izh.parsers.tool_grammar import auto_tool_call_grammar, tool_call_grammar
from izh.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer


@dataclass(frozen=True, slots=True)
class Constraint:
    """One output constraint of a request, and the request field it came from (named in 400s)."""

    spec: StructuredOutputsParams
    param: str


# vLLM structured_outputs keys that only choose a backend or loosen whitespace: ignoring them never
# lets unconstrained output through. Any other unknown key is refused by name.
_IGNORED_STRUCTURED_KEYS = frozenset({"backend", "disable_fallback", "disable_any_whitespace"})


def _spec(param: str, **fields: Any) -> StructuredOutputsParams:
    """A validated spec whose errors name `param` (the field the client actually sent)."""
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message.replace("structured_outputs", param), param=param) from None


def _schema_text(schema: dict[str, Any] | bool | str, param: str) -> str:
    """A schema as JSON text: a string is taken as JSON text already (vLLM accepts both)."""
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise InvalidRequest(f"{param}: the schema is not valid JSON: {exc}", param=param) from None


def _response_format_spec(fmt: ResponseFormat) -> StructuredOutputsParams | None:
    param = "response_format"
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        if fmt.schema_ is not None:  # llama.cpp's {"type": "json_object", "schema": {...}}
            return _spec(param, json=_schema_text(fmt.schema_, param))
        return _spec(param, json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest(
                'response_format of type "json_schema" needs json_schema.schema', param=param
            )
        return _spec(param, json=_schema_text(fmt.json_schema.schema_, param))
    raise InvalidRequest(
        f"response_format type {fmt.type!r} is not supported; use text, json_object or json_schema",
        param=param,
        code="unsupported",
    )


def _structured_outputs_spec(request: StructuredOutputsRequest) -> StructuredOutputsParams:
    param = "structured_outputs"
    unknown = sorted(
        key
        for key, value in (request.model_extra or {}).items()
        if value is not None and key not in _IGNORED_STRUCTURED_KEYS
    )
    if unknown:
        raise InvalidRequest(
            f"structured_outputs.{unknown[0]} is not supported; use one of json, regex, choice, "
            "grammar, json_object",
            param=param,
            code="unsupported",
        )
    return _spec(
        param,
        json=None if request.json_ is None else _schema_text(request.json_, param),
        regex=request.regex,
        choice=request.choice,
        grammar=request.grammar,
        json_object=bool(request.json_object),
    )


def requested_constraints(body: SamplingFields) -> list[Constraint]:
    """Every output constraint `body` asks for: response_format, structured_outputs, guided_*."""
    found: list[Constraint] = []
    if body.response_format is not None:
        spec = _response_format_spec(body.response_format)
        if spec is not None:
            found.append(Constraint(spec, "response_format"))
    if body.structured_outputs is not None:
        found.append(Constraint(_structured_outputs_spec(body.structured_outputs), "structured_outputs"))
    if body.guided_json is not None:
        schema = _schema_text(body.guided_json, "guided_json")
        found.append(Constraint(_spec("guided_json", json=schema), "guided_json"))
    if body.guided_regex is not None:
        found.append(Constraint(_spec("guided_regex", regex=body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append(Constraint(_spec("guided_choice", choice=body.guided_choice), "guided_choice"))
    if body.guided_grammar is not None:
        found.append(Constraint(_spec("guided_grammar", grammar=body.guided_grammar), "guided_grammar"))
    return found


def single_constraint(constraints: list[Constraint]) -> Constraint | None:
    """The request's one constraint; two at once are a 400 (which should win is not ours to guess)."""
    if len(constraints) > 1:
        names = " and ".join(constraint.param for constraint in constraints)
        raise InvalidRequest(
            f"only one output constraint per request is supported, got {names}", param=constraints[1].param
        )
    return constraints[0] if constraints else None


async def ll_tokenizer(state: ApiState) -> LLTokenizer:
    """llguidance's tokenizer for the served model, built once (off the event loop) and cached."""
    if state.ll_tokenizer is None:
        async with state.ll_tokenizer_lock:
            if state.ll_tokenizer is None:
                llm = state.llm
                try:
                    state.ll_tokenizer = await asyncio.to_thread(
                        build_ll_tokenizer, llm.tokenizer, llm.ready.vocab_size
                    )
                except ValueError as exc:
                    raise InvalidRequest(
                        f"structured outputs are not available for this model: {exc}", code="unsupported"
                    ) from None
    return state.ll_tokenizer


async def check_constraint(state: ApiState, constraint: Constraint) -> None:
    """400 naming the problem unless the engine can enforce `constraint` (grammars are compiled
    off the event loop; results are cached by spec)."""
    tokenizer = await ll_tokenizer(state)
    await asyncio.to_thread(validate_spec, constraint.spec, tokenizer, param=constraint.param)


# --- constraining only the answer of a reasoning model ----------------------------------------------

# The reasoning: free text up to and including the first `</think>` (a lazy lexeme stops there).
_THINK_RULES = "\n".join(
    [
        r"izh_think[lazy]: /(.|\n)*<\/think>/",
        r"IZH_GAP: /[ \t\r\n]{1,8}/",
    ]
)
_LARK_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def answer_only(constraint: Constraint, *, in_reasoning: bool) -> Constraint:
    """`constraint` applied to the answer after a `<think>...</think>` block, the reasoning left free.

    `in_reasoning`: the prompt left a `<think>` open, so the output must first close it. Otherwise
    the output may open (and close) a think block before the answer, as the reasoning parser
    allows. Returns a Lark grammar: the answer rule, then the think rules.
    """
    spec = constraint.spec
    if in_reasoning:
        start = "start: izh_think IZH_GAP? izh_answer"
    else:
        start = 'start: (IZH_GAP? "<think>" izh_think IZH_GAP?)? izh_answer'
    grammar = "\n".join([_answer_rules(spec), start, _THINK_RULES]) + "\n"
    return Constraint(StructuredOutputsParams(grammar=grammar), constraint.param)


def _answer_rules(spec: StructuredOutputsParams) -> str:
    """Lark rules defining `izh_answer` as what `spec` accepts."""
    if spec.json is not None or spec.json_object:
        schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
        if schema is True:
            schema = {}
        # The same options as a plain JSON spec (guided_spec.json_compile_options), inline.
        schema = {**schema, "x-guidance": dict(json_compile_options())}
        return f"izh_answer: %json {json.dumps(schema, ensure_ascii=False)}"
    if spec.regex is not None:
        return f"izh_answer: /{llguidance.regex_to_lark(spec.regex, '')}/"
    if spec.choice is not None:
        return "izh_answer: " + " | ".join(lark_literal(choice) for choice in spec.choice)
    assert spec.grammar is not None
    return rename_lark_rule(any_to_lark(spec.grammar), "start", "izh_answer")


def rename_lark_rule(grammar: str, old: str, new: str) -> str:
    """`grammar` with the rule name `old` renamed to `new` wherever it is a name: string literals,
    regexes, comments and special-token references are left alone (`lark_opaque_end`)."""
    out: list[str] = []
    position = 0
    while position < len(grammar):
        if (end := lark_opaque_end(grammar, position)) is None:
            if (name := _LARK_IDENTIFIER.match(grammar, position)) is not None:
                out.append(new if name.group() == old else name.group())
                position = name.end()
                continue
            end = position + 1
        out.append(grammar[position:end])
        position = end
    return "".join(out)


async def answer_constraint(
    state: ApiState, constraint: Constraint, *, reasoning: bool, prompt_text: str, starts_in_reasoning: bool
) -> Constraint:
    """`constraint` checked enforceable; with a reasoning parser (`reasoning`), applied to the answer
    only (answer_only) and checked again."""
    await check_constraint(state, constraint)
    # A generation prompt that already closed the think block (Qwen3's enable_thinking=false)
    # leaves only the answer to generate.
    if reasoning and not prompt_text.rstrip().endswith(THINK_END):
        constraint = answer_only(constraint, in_reasoning=starts_in_reasoning)
        await check_constraint(state, constraint)
    return constraint


# --- forced tool calls ------------------------------------------------------------------------------


def effective_tool_choice(body: ChatCompletionRequest) -> str | NamedToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if body.tool_choice is not None:
        return body.tool_choice
    return "auto" if body.tools else "none"


def tool_call_constraint(
    body: ChatCompletionRequest, tool_choice: str | NamedToolChoice
) -> Constraint | None:
    """The grammar forcing tool calls for "required" or a named tool (None for auto and none)."""
    if tool_choice in ("auto", "none"):
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
    spec = tool_call_grammar(tools, choice, body.parallel_tool_calls)
    return None if spec is None else Constraint(spec, "tool_choice")


def auto_tool_constraint(body: ChatCompletionRequest) -> Constraint | None:
    """tool_choice "auto" with Hermes calls: text, or well-formed calls (auto_tool_call_grammar)."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    spec = auto_tool_call_grammar(tools, body.parallel_tool_calls)
    return None if spec is None else Constraint(spec, "tools")
