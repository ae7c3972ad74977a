"""The bodies of the ops routes' requests and replies: /v1/models, the LoRA adapter routes, /tokenize,
/detokenize and /tokenizer_info (vLLM's shapes), as pydantic models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from izh.api.common.chat_protocol import ChatMessageParam, ToolParam
from izh.api.common.protocol import RequestBase

# --- /v1/models ---------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "izh"
    root: str | None = None
    parent: str | None = None
    """For a LoRA adapter: the base model's id (vLLM's field)."""
    max_model_len: int | None = None


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body, without its unused lora_int_id)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- /tokenize, /detokenize (vLLM's shapes) ----------------------------------------------------------


class TokenizeRequest(RequestBase):
    """Either `prompt` (a completion prompt) or `messages` (rendered through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBase):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info: vLLM's shape, the served tokenizer as tokenizer_config.json spells it
    (plus the special token ids); other special tokens the model names (sep_token, ...) are extras."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    model_max_length: int
    clean_up_tokenization_spaces: bool
    chat_template: str | None
    added_tokens_decoder: dict[str, str]
    """Token id -> content of every added token, as vLLM flattens transformers' AddedToken."""
