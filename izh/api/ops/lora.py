"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded at runtime.

vLLM's routes and bodies ({"lora_name", "lora_path"} / {"lora_name"}), answered like vLLM's (a plain
text success line). They serve only with `server.allow_runtime_lora_updating` (off by default: a
404 saying how to turn them on), behind the API keys as every non-public route. The adapter is read
by the engine core (izh.engine.lora_manager); the refusals are OpenAI-format errors: an unknown adapter
a 404, a name in use, a rank above max_lora_rank or a folder that cannot be served a 400 saying why.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from izh.api.common.state import ApiState, api_state, check_serving, read_json
from izh.api.ops.protocol import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from izh.errors import NotFound

logger = logging.getLogger(__name__)


def _check_enabled(state: ApiState) -> None:
    if not state.allow_lora_updating:
        raise NotFound(
            "loading LoRA adapters at runtime is off; start the server with --allow-runtime-lora-updating "
            "(server.allow_runtime_lora_updating)",
            code="lora_updating_disabled",
        )


async def load_lora_adapter(request: Request) -> Response:
    state = api_state(request)
    _check_enabled(state)
    check_serving(request)
    body = await read_json(request, LoadLoraAdapterRequest)
    path = await state.llm.load_lora_adapter(body.lora_name, body.lora_path)
    logger.info("LoRA adapter %s loaded from %s", body.lora_name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = api_state(request)
    _check_enabled(state)
    check_serving(request)
    body = await read_json(request, UnloadLoraAdapterRequest)
    await state.llm.unload_lora_adapter(body.lora_name)
    logger.info("LoRA adapter %s unloaded", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
