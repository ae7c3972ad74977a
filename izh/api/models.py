"""GET /v1/models and /v1/models/{id}: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from izh.api.protocol import ModelCard, ModelList
from izh.api.state import ApiState, api_state, json_response
from izh.errors import ModelNotFound


def model_card(state: ApiState) -> ModelCard:
    return ModelCard(
        id=state.model_name,
        created=state.created,
        root=state.model_name,
        max_model_len=state.max_model_len,
    )


async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=[model_card(api_state(request))]))


async def retrieve_model(request: Request, model_id: str) -> Response:
    """The model's card; any other id is a 404 model_not_found."""
    state = api_state(request)
    if model_id != state.model_name:
        raise ModelNotFound(f"The model `{model_id}` does not exist.", param="model")
    return json_response(model_card(state))
