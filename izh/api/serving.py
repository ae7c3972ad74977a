"""What the generation routes share: the app's state, sampling params with the model's defaults,
fan-out of n x prompts into admitted child requests, merging their streams, logprobs and usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from izh.api.protocol import (
    ChatLogprobEntry,
    CompletionLogprobs,
    PromptTokensDetails,
    RequestModel,
    ResponseFormat,
    SamplingFields,
    StructuredOutputsRequest,
    TopLogprob,
    UsageInfo,
    parse_body,
)
from izh.api.sse import SSEResponse, sse_stream
from izh.errors import ContextLengthExceeded, EngineDead, InvalidRequest, ModelNotFound, Overloaded
from izh.guided_spec import build_ll_tokenizer, json_compile_options, lark_literal, validate_spec
from izh.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer

    from izh.api.metrics import PrometheusStatLogger
    from izh.frontend.async_llm import AsyncLLM, RequestStream
    from izh.frontend.output_processor import PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI's convention for "practically impossible".
MIN_LOGPROB = -9999.0
MAX_CHILD_REQUESTS = 1024
"""Most child requests (prompts x n) one HTTP request may fan out into."""
# The generation_config.json keys that are sampling defaults (vLLM's --generation-config auto).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

T = TypeVar("T")


@dataclass(slots=True)
class ApiState:
    """Everything a route needs, on `app.state.izh` (the draining flag is `app.state.draining`)."""

    llm: AsyncLLM
    model_name: str
    max_model_len: int
    max_body_bytes: int
    sse_keepalive_s: float | None
    reasoning_parser: str | None
    default_request_timeout_s: float | None
    metrics: PrometheusStatLogger
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    created: int = 0
    tool_call_parser: str = "auto"
    """The configured tool-call parser name ("auto": from the chat template; "none": no parsing)."""
    ll_tokenizer: LLTokenizer | None = None
    """llguidance's view of the tokenizer, built on the first structured request (see ll_tokenizer)."""
    ll_tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def api_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.izh
    return state


def request_id_of(request: Request) -> str:
    """The id the app's middleware gave this request (the X-Request-Id it echoes, made unique)."""
    request_id = getattr(request.state, "request_id", None)
    return request_id if isinstance(request_id, str) else uuid.uuid4().hex


def json_response(body: BaseModel, status_code: int = 200) -> Response:
    """A pydantic body as JSON (serialized by pydantic, without FastAPI's re-validation)."""
    return Response(body.model_dump_json(), status_code=status_code, media_type="application/json")


def check_model(state: ApiState, model: str | None) -> None:
    """A request may omit the model; naming another one is a 404 model_not_found."""
    if model and model != state.model_name:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


def check_serving(request: Request) -> None:
    """Refuse new generation work while draining (503 with Retry-After) or when the core is dead."""
    llm = api_state(request).llm
    if llm.is_dead:
        raise EngineDead(f"the engine core is dead: {llm.dead_reason}")
    if getattr(request.app.state, "draining", False):
        raise Overloaded("server is shutting down")


async def read_json(request: Request, model: type[RequestModel]) -> RequestModel:
    """The validated body of a POST route (bounded by max_body_bytes)."""
    return await parse_body(request, model, api_state(request).max_body_bytes)


# --- sampling params ------------------------------------------------------------------------------


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The model's sampling defaults from generation_config.json (numbers only; junk is skipped).

    `max_new_tokens` becomes the default max_tokens. As with vLLM's `--generation-config auto`, a
    request's own values always win.
    """
    defaults: dict[str, Any] = {}
    for key in _GENERATION_CONFIG_KEYS:
        value = generation_config.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults[key] = value
    max_new_tokens = generation_config.get("max_new_tokens")
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens > 0:
        defaults["max_tokens"] = max_new_tokens
    return defaults


def resolve_max_tokens(
    requested: int | None,
    *,
    explicit: bool,
    default: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    param: str,
) -> int:
    """The max_tokens to run with, or ContextLengthExceeded with the numbers.

    A client's explicit max_tokens must fit beside the prompt (OpenAI's behaviour); a default is
    clamped to the room left instead.
    """
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens, which leaves no room for the completion. Please reduce "
            f"the length of the {param}.",
            param=param,
        )
    if explicit and requested is not None:
        if requested >= 1 and requested > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {param}, {requested} "
                f"in the completion). Please reduce the length of the {param} or the completion.",
                param="max_tokens",
            )
        return requested
    value = requested if requested is not None else default
    return room if value is None else min(value, room)


def build_sampling_params(
    body: SamplingFields,
    defaults: dict[str, Any],
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams for `body`: the request's values, else the model's defaults, else vLLM's.

    Validated on construction: a bad value raises InvalidRequest naming its field.
    """
    values: dict[str, Any] = {
        "n": body.n,
        "presence_penalty": body.presence_penalty if body.presence_penalty is not None else 0.0,
        "frequency_penalty": body.frequency_penalty if body.frequency_penalty is not None else 0.0,
        "seed": body.seed,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": body.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "logit_bias": dict(body.logit_bias) if body.logit_bias else None,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "structured_outputs": structured_outputs,
    }
    for key in _GENERATION_CONFIG_KEYS:
        value = getattr(body, key)
        if value is None:
            value = defaults.get(key)
        if value is not None:
            values[key] = value
    return SamplingParams(**values)


# --- structured outputs ---------------------------------------------------------------------------


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
_LARK_TOKEN_REFERENCE = re.compile(r"<[^<>\s]+>")


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
    regexes, comments and special-token references are left alone."""
    out: list[str] = []
    position = 0
    while position < len(grammar):
        char = grammar[position]
        if char == '"' or (char == "/" and not grammar.startswith("//", position)):
            end = _quoted_end(grammar, position)
        elif char == "#" or grammar.startswith("//", position):
            newline = grammar.find("\n", position)
            end = len(grammar) if newline < 0 else newline
        elif char == "<" and (token := _LARK_TOKEN_REFERENCE.match(grammar, position)):
            end = token.end()
        elif (name := _LARK_IDENTIFIER.match(grammar, position)) is not None:
            out.append(new if name.group() == old else name.group())
            position = name.end()
            continue
        else:
            end = position + 1
        out.append(grammar[position:end])
        position = end
    return "".join(out)


def _quoted_end(text: str, start: int) -> int:
    """The index after the literal opened by the quote at `start` (backslash escapes skipped)."""
    quote = text[start]
    position = start + 1
    while position < len(text):
        if text[position] == "\\":
            position += 2
        elif text[position] == quote:
            return position + 1
        else:
            position += 1
    return len(text)


def check_prompt_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids:
        raise InvalidRequest(f"the {param} is empty", param=param)
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(f"{param} token id {bad} is out of range [0, {vocab_size})", param=param)


# --- fan-out and admission ------------------------------------------------------------------------


@dataclass(slots=True)
class Child:
    """One child request: choice `index` = prompt_index * n + sample_index."""

    index: int
    prompt_index: int
    sample_index: int
    stream: RequestStream


def child_params(params: SamplingParams, sample_index: int) -> SamplingParams:
    """The params of one of n samples: n=1, and distinct seeds so seeded samples still differ."""
    seed = params.seed
    if seed is not None and sample_index:
        seed = seed + sample_index
    return msgspec.structs.replace(params, n=1, seed=seed)


async def admit(
    state: ApiState,
    base_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    priority: int,
    cache_salt: str | None,
) -> list[Child]:
    """Add every child request (ids `{base_id}-{i}`) before anything is streamed.

    `params[i]` (with the request's n) goes with `prompts[i]`. If any child is refused
    (overloaded, context length, ...), the admitted ones are aborted and the refusal propagates,
    so the client gets a real HTTP status.
    """
    n = params[0].n
    if len(prompts) * n > MAX_CHILD_REQUESTS:
        raise InvalidRequest(
            f"a request may ask for at most {MAX_CHILD_REQUESTS} completions (prompts x n), "
            f"got {len(prompts)} x {n}",
            param="n",
        )
    children: list[Child] = []
    try:
        for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            for sample_index in range(n):
                index = prompt_index * n + sample_index
                stream = await state.llm.add_request(
                    f"{base_id}-{index}",
                    prompt,
                    child_params(prompt_params, sample_index),
                    priority=priority,
                    cache_salt=cache_salt,
                    deadline_s=state.default_request_timeout_s,
                )
                children.append(Child(index, prompt_index, sample_index, stream))
    except BaseException:
        for child in children:
            child.stream.abort()
        raise
    return children


async def merge_outputs(children: list[Child]) -> AsyncIterator[tuple[Child, RequestOutput]]:
    """The outputs of all children as they come. Closing this generator aborts unfinished children.

    One pending read per child keeps each child's backpressure: outputs a slow client has not
    taken are merged by its RequestStream, never queued here.
    """
    if len(children) == 1:
        # The common case (one prompt, n = 1): no futures and no wait per token.
        child = children[0]
        try:
            async for out in child.stream:
                yield child, out
        finally:
            child.stream.abort()
        return
    pending: dict[asyncio.Future[RequestOutput], Child] = {}
    try:
        for child in children:
            pending[asyncio.ensure_future(anext(child.stream))] = child
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f].index):
                child = pending.pop(future)
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                if not out.finished:
                    pending[asyncio.ensure_future(anext(child.stream))] = child
                yield child, out
    finally:
        for future in pending:
            future.cancel()
        if pending:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(pending)
        for child in children:
            child.stream.abort()


def abort_all(children: list[Child]) -> None:
    for child in children:
        child.stream.abort()


async def respond(
    request: Request,
    children: list[Child],
    *,
    stream: bool,
    events: Callable[[], AsyncIterator[bytes]],
    collect: Callable[[], Awaitable[Any]],
    keepalive_s: float | None,
    request_id: str,
) -> Response:
    """The route's answer: an SSE stream of `events()`, or the JSON that `collect()` builds, aborting
    the children when the client goes away (or the route fails) either way."""
    if stream:
        body = sse_stream(events(), keepalive_s=keepalive_s, request_id=request_id)
        return SSEResponse(body, on_close=lambda: abort_all(children))
    try:
        result = await until_disconnected(request, collect())
    finally:
        abort_all(children)
    return result if isinstance(result, Response) else json_response(result)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Run `work`; if the client disconnects first, cancel it (aborting its requests).

    After the body is read, the next ASGI receive() returns only when the client goes away.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (task, watcher):
            if not future.done():
                future.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({task, watcher})
    if task.cancelled():
        logger.info("[%s] client disconnected; request aborted", request_id_of(request))
        # Nobody is there to read it; 499 is nginx's "client closed request".
        return Response(status_code=499)
    return task.result()


async def _wait_for_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# --- logprobs and usage ---------------------------------------------------------------------------


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(positions: list[PositionLogprobs], top_logprobs: int) -> list[ChatLogprobEntry]:
    """Chat's `logprobs.content` entries for generated positions."""
    return [
        ChatLogprobEntry(
            token=p.chosen.token,
            logprob=_finite(p.chosen.logprob),
            bytes=p.chosen.token_bytes,
            top_logprobs=[
                TopLogprob(token=t.token, logprob=_finite(t.logprob), bytes=t.token_bytes)
                for t in p.top[:top_logprobs]
            ],
        )
        for p in positions
    ]


def append_completion_logprobs(
    into: CompletionLogprobs,
    positions: list[PositionLogprobs | None],
    num_top: int,
    text_offset: int,
    prompt_token_strs: list[str] | None = None,
) -> int:
    """Extend the legacy completions shape; returns the text offset after the last token.

    A None position (the first prompt token has no logprob) needs its token text from
    `prompt_token_strs`. Like vLLM, the chosen token is always among its position's top_logprobs.
    """
    for i, position in enumerate(positions):
        if position is None:
            token = prompt_token_strs[i] if prompt_token_strs is not None else ""
            into.tokens.append(token)
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            token = position.chosen.token
            into.tokens.append(token)
            into.token_logprobs.append(_finite(position.chosen.logprob))
            top = {t.token: _finite(t.logprob) for t in position.top[:num_top]}
            top.setdefault(token, _finite(position.chosen.logprob))
            into.top_logprobs.append(top)
        into.text_offset.append(text_offset)
        text_offset += len(token)
    return text_offset


def prompt_logprobs_json(
    positions: list[PositionLogprobs | None] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` response field: per position {token_id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    result: list[dict[str, Any] | None] = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        entry = {
            str(t.token_id): {"logprob": _finite(t.logprob), "rank": None, "decoded_token": t.token}
            for t in position.top
        }
        entry[str(position.chosen.token_id)] = {
            "logprob": _finite(position.chosen.logprob),
            "rank": position.rank,
            "decoded_token": position.chosen.token,
        }
        result.append(entry)
    return result


@dataclass(slots=True)
class UsageCounter:
    """Token counts of one HTTP request: each prompt counted once however many samples it has."""

    num_prompt_tokens: dict[int, int] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    num_output_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, child: Child, out: RequestOutput) -> None:
        # Each prompt's first sample speaks for its prompt (later samples hit its cached prefix);
        # until it has spoken, any sample of that prompt does.
        if child.sample_index == 0 or child.prompt_index not in self.num_prompt_tokens:
            self.num_prompt_tokens[child.prompt_index] = out.num_prompt_tokens
            self.num_cached_tokens[child.prompt_index] = out.num_cached_tokens
        self.num_output_tokens[child.index] = out.num_output_tokens

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(self.num_prompt_tokens.values())
        completion_tokens = sum(self.num_output_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.num_cached_tokens.values())),
        )
