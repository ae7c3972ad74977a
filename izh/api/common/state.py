"""The app's state and the plumbing every route shares: ApiState on `app.state.izh`, the request's id,
the model and serving checks, reading a validated body and answering with one.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from izh.api.common.protocol import RequestModel, parse_body
from izh.api.responses.reasoning import ReasoningSeal
from izh.api.responses.store import ResponseStore
from izh.errors import EngineDead, InvalidRequest, ModelNotFound, Overloaded
from izh.frontend.input_processor import cannot_generate_message
from izh.settings import LimitSettings

if TYPE_CHECKING:
    from llguidance import LLTokenizer

    from izh.api.ops.metrics import PrometheusStatLogger
    from izh.frontend.async_llm import AsyncLLM


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
    """llguidance's view of the tokenizer, built on the first structured request (by constraints)."""
    ll_tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    responses_store: ResponseStore = field(default_factory=ResponseStore)
    """The stored responses of /v1/responses (`store: true`), bounded by server.responses_store_max."""
    reasoning_seal: ReasoningSeal = field(default_factory=ReasoningSeal.generated)
    """Seals the reasoning items' encrypted_content (a key made at start: tokens die with the process)."""
    limits: LimitSettings = field(default_factory=LimitSettings)
    """The `[limits]` section (the image limits are read by the routes; the rest by the guard)."""
    allow_lora_updating: bool = False
    """server.allow_runtime_lora_updating: /v1/load_lora_adapter and /v1/unload_lora_adapter serve."""


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


def check_model(state: ApiState, model: str | None) -> str | None:
    """The LoRA adapter a request names in `model` (None: it omits the model or names the base one); any
    other name is a 404 model_not_found."""
    if not model or model == state.model_name:
        return None
    if model in state.llm.lora_adapters:
        return model
    raise ModelNotFound(f"The model `{model}` does not exist.", param="model")


def check_can_generate(state: ApiState) -> None:
    """A generation route on a model that only pools (an embedding encoder, a cross-encoder) is a 400
    naming `model`, before anything else about the request (its chat template, say) is looked at.
    The input processor refuses such requests too; this only says it first."""
    ready = state.llm.ready
    if not ready.can_generate:
        raise InvalidRequest(
            cannot_generate_message(ready.pooling_task, f"the model `{state.model_name}`"),
            param="model",
            code="model_cannot_generate",
        )


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
