"""GET /v1/models and /v1/models/{id}: the base model and the LoRA adapters served on it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from izh.api.common.state import ApiState, api_state, json_response
from izh.api.ops.protocol import (
    ModelCard,
    ModelList,
)
from izh.errors import ModelNotFound


def model_card(state: ApiState) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=state.model_name,
        max_model_len=state.max_model_len,
    )


def adapter_card(state: ApiState, name: str, path: str) -> ModelCard:
    """A LoRA adapter's card: `root` its folder, `parent` the base model (as vLLM lists them)."""
    return ModelCard(
        id=name, created=state.created, root=path, parent=state.model_name, max_model_len=state.max_model_len
    )


async def list_models(request: Request) -> Response:
    state = api_state(request)
    adapters = [adapter_card(state, name, path) for name, path in state.llm.lora_adapters.items()]
    return json_response(ModelList(data=[model_card(state), *adapters]))


async def retrieve_model(request: Request, model_id: str) -> Response:
    """The card of the model or of a LoRA adapter; any other id is a 404 model_not_found."""
    state = api_state(request)
    if model_id == state.model_name:
        return json_response(model_card(state))
    path = state.llm.lora_adapters.get(model_id)
    if path is None:
        raise ModelNotFound(f"The model `{model_id}` does not exist.", param="model")
    return json_response(adapter_card(state, model_id, path))
