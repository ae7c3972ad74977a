"""OpenAI's request and response bodies (plus vLLM's extensions) as pydantic models: reading a body,
the pieces every generation request shares (SamplingFields), /v1/completions and /v1/embeddings.
Chat's bodies are izh.api.common.chat_protocol, the ops routes' izh.api.ops.protocol, the Responses
API's izh.api.responses.protocol.

Requests ignore unknown fields (clients send fields from newer API versions). Types are checked
here; values (ranges, token ids, lengths) are checked once by SamplingParams and the routes, so
that every rejection names its field in OpenAI's error envelope.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request

from izh.api.common.errors import validation_error_to_invalid_request
from izh.errors import InvalidRequest, PayloadTooLarge

# --- reading a body -----------------------------------------------------------------------------

RequestModel = TypeVar("RequestModel", bound=BaseModel)
PARSED_BODY = "parsed_body"
"""The key of the ParsedBody in the ASGI scope's state (request.state.parsed_body)."""


@dataclass(frozen=True, slots=True)
class ParsedBody:
    """A JSON body the request guard has read and parsed already, for the route to validate."""

    raw: bytes
    value: Any
    """What pydantic's JSON parser reads `raw` as (izh.api.guard.limits.parse_json)."""


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body, refusing (413) as soon as more than max_body_bytes have arrived.

    Content-Length is checked up front by the app's middleware; this counts what actually streams
    in, so a lying or absent Content-Length (chunked upload) cannot make us buffer without bound.
    """
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_body_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[RequestModel], max_body_bytes: int) -> RequestModel:
    """Validate a JSON body: malformed JSON and wrong types are 400s naming the field.

    The value the request guard parsed is validated as it is (`model_validate`); a request that
    did not pass the guard's parsing (not JSON, or an app without the guard) is read and parsed here.
    """
    parsed = request.scope.get("state", {}).get(PARSED_BODY)
    if isinstance(parsed, ParsedBody):
        try:
            return model.model_validate(parsed.value)
        except pydantic.ValidationError:
            # pydantic words errors by the input's kind ("a valid list" for Python data, "a valid
            # array" for JSON): the JSON text is validated again, so that the 400 reads as ever.
            body = parsed.raw
    else:
        body = await read_body(request, max_body_bytes)
    if not body.strip():
        raise InvalidRequest("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0]["type"] == "json_invalid":
            raise InvalidRequest(f"the request body is not valid JSON: {errors[0]['msg']}") from None
        raise validation_error_to_invalid_request(exc) from None


# Ints that cross to the engine core as msgpack must fit in 64 bits; bigger is a 400, not a crash.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

# --- shared request pieces ------------------------------------------------------------------------


class RequestBase(BaseModel):
    """Unknown fields are ignored, as OpenAI's own server and vLLM do."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(RequestBase):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object.

    Unknown keys are kept (not ignored) so that a constraint izh does not implement is refused by
    name instead of silently producing unconstrained output.
    """

    model_config = ConfigDict(extra="allow")

    json_: dict[str, Any] | StrictBool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(RequestBase):
    """`response_format.json_schema`: OpenAI's named schema (izh always enforces it strictly)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBase):
    """OpenAI's `response_format`: text, json_object or json_schema.

    `schema` beside type json_object is llama.cpp's spelling of a schema, accepted too.
    """

    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")


class SamplingFields(RequestBase):
    """The sampling fields chat and completions share: OpenAI's, then vLLM's extensions."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extensions.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    speculative_decoding: bool = True
    """izh's extension: false opts the request out of speculative decoding (docs/operations.md)."""
    priority: Int64 = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    # Structured outputs: vLLM's object, its older guided_* fields, and OpenAI's response_format.
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictBool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None


# --- /v1/completions ----------------------------------------------------------------------------

CompletionPrompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# --- /v1/embeddings -----------------------------------------------------------------------------


class EmbeddingRequest(RequestBase):
    """OpenAI's embeddings request (plus vLLM's add_special_tokens). `input` is a string, a list of
    strings, a list of token ids or a list of those (as a completion's prompt)."""

    model: str | None = None
    input: CompletionPrompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    """Accepted for OpenAI's clients; it only identifies the end user (izh's request log has the key)."""
    add_special_tokens: bool = True
    """vLLM's: add the tokenizer's special tokens ([CLS] ... [SEP] for BERT, BOS for a decoder)."""
    truncate_prompt_tokens: Int64 | None = None
    """vLLM's; refused with a 400 when set: izh refuses a too-long input, as OpenAI does."""


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """Floats, or (encoding_format base64) the little-endian float32 bytes in base64."""


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
