"""IzhSettings: every user-facing setting, layered defaults < TOML file < IZH_* environment < flags.

This is the only module in izh that reads ``os.environ``. Build settings with :func:`load_settings`; it
layers the sources itself (rather than through pydantic-settings' own sources) so that every bad value
can be reported with the place it came from, in one line::

    engine.max_num_seqs: Input should be greater than 0 (got -1, from environment variable IZH_ENGINE__MAX_NUM_SEQS)

Sources, lowest precedence first:

* the defaults below;
* a TOML file (``--config FILE``) whose tables match the sections (``[model]``, ``[engine]``, ``[server]``,
  ``[limits]``, ``[rate_limits]``, ``[logging]``; see ``examples/config.toml``); unknown tables or keys
  are errors, so typos are caught;
* environment variables ``IZH_<SECTION>__<FIELD>`` (``IZH_ENGINE__MAX_NUM_SEQS=64``); an ``IZH_*`` variable
  naming a known section but an unknown field is an error. ``IZH_CACHE_DIR`` is a shortcut for
  ``model.cache_dir``, ``IZH_CPU_KERNELS`` for ``engine.cpu_kernels`` (``0`` = off). An empty value (or
  ``none``) unsets an optional field. Lists take a JSON list or a comma-separated string;
* command-line flags, passed to :func:`load_settings` as ``overrides`` keyed by dotted name.

Flag naming rule (:func:`settings_flag_specs`): every field gets one flag named after the field, vLLM
style, with ``_`` turned into ``-`` (``engine.max_num_seqs`` → ``--max-num-seqs``, ``server.port`` →
``--port``). A field name found in two sections is prefixed with its section (``--engine-foo``). A few
fields are renamed in ``_FLAG_NAMES``: list fields take a singular, repeatable flag (``--api-key``,
``--allowed-origin``) and ``[logging]`` fields take a ``log`` prefix (``--log-level``, ``--log-json``).
Booleans get a ``--no-`` twin. ``model.name`` has no flag: it is the positional MODEL argument.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import re
import tomllib
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, cast, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

if TYPE_CHECKING:
    from izh.config import EngineConfig, SpeculativeConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = "IZH_"
ENV_NESTED_DELIMITER = "__"
# Shortcut variables, each standing for one dotted setting; the nested form wins when both are set.
_ENV_SHORTCUTS: dict[str, str] = {"IZH_CACHE_DIR": "model.cache_dir", "IZH_CPU_KERNELS": "engine.cpu_kernels"}
_NONE_WORDS = frozenset({"", "none", "null"})
DEFAULT_CACHE_DIR = "~/.cache/izh"
_MASK = "**********"


class SettingsError(ValueError):
    """A setting is missing, unknown or invalid; the message is one line naming field, value and source."""


# ---------------------------------------------------------------------------------------------------
# Value parsers shared by several fields


_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$")


def parse_byte_size(value: Any) -> Any:
    """Turn "2GiB", "512MB", "1.5 GiB" or "1024" into an int number of bytes; other values pass through.

    Units: B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (powers of 1024), case-insensitive.
    """
    if not isinstance(value, str):
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError("expected a size such as 2GiB, 512MB or 1073741824")
    unit = match[2].lower()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown size unit {match[2]!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")
    try:
        return int(Decimal(match[1]) * _SIZE_UNITS[unit])
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimal numbers
        raise ValueError(f"not a number: {match[1]!r}") from exc


def parse_string_list(value: Any) -> Any:
    """Accept a list as is, or a string holding a JSON list or comma-separated items (from env or flags)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a valid JSON list ({exc.msg})") from exc
        return parsed
    return [item.strip() for item in text.split(",") if item.strip()]


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


CPU_KERNEL_CHOICES = ("auto", "off", "generic", "avx2", "avx512", "amx", "neon")
_OFF_WORDS = frozenset({"0", "false", "no", "off"})
_ON_WORDS = frozenset({"1", "true", "yes", "on"})


def parse_cpu_kernels(value: Any) -> Any:
    """engine.cpu_kernels: lowercased; 0 / false / no mean off and 1 / true / yes / on mean auto (the old
    IZH_CPU_KERNELS=0 switch); other values pass through to the choices check."""
    if isinstance(value, bool):
        return "auto" if value else "off"
    if not isinstance(value, str):
        return value
    word = value.strip().lower()
    return "off" if word in _OFF_WORDS else "auto" if word in _ON_WORDS else word


ByteSize = BeforeValidator(parse_byte_size)
StringList = BeforeValidator(parse_string_list)
CaseInsensitive = BeforeValidator(_lower)


# ---------------------------------------------------------------------------------------------------
# The sections


def parse_lora_module(entry: str) -> tuple[str, str]:
    """ "name=path" -> (name, path)."""
    name, sep, path = entry.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"expected name=path for a LoRA adapter, got {entry!r}")
    return name, path


class _Section(BaseModel):
    # Unknown keys are errors (typos must not be ignored); settings are resolved once and never mutated.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)


class ModelSettings(_Section):
    """[model]: which model to serve and how to load it."""

    name: str = Field(
        default="smollm2",
        min_length=1,
        description="Model to serve: a registry name (smollm2; all-minilm-l6-v2 for embeddings), a local "
        ".gguf file or a Hugging Face folder.",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        description="Model name reported by the API (/v1/models, the 'model' field); unset = the model name.",
    )
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], CaseInsensitive] = Field(
        default="auto",
        description="Weight and activation dtype; auto is bfloat16 on CUDA and float32 on CPU (a packed "
        "model's matmuls then run izh's integer record kernels at every batch size: batch-invariant "
        "logits).",
    )
    quantization: Annotated[Literal["auto", "none", "int4", "int8"], CaseInsensitive] = Field(
        default="auto",
        description="Weight-only packed matmuls on CPU (every step in float32; with an explicit "
        "bfloat16 dtype, decode steps of up to 8 or 64 rows, dense copies above): auto packs what a GGUF stores quantized (Q4 as int4, exact); int4 / "
        "int8 pack every linear (lossy for a float checkpoint); none keeps dense weights only.",
    )
    device: Annotated[Literal["auto", "cpu", "cuda"], CaseInsensitive] = Field(
        default="auto", description="Device to run on; auto picks CUDA when available, else CPU."
    )
    max_model_len: int | None = Field(
        default=None, gt=0, description="Context length in tokens (prompt + output); unset = the model's own."
    )
    pooling: Annotated[Literal["auto", "mean", "cls", "last"], CaseInsensitive] = Field(
        default="auto",
        description="How /v1/embeddings pools the final hidden states: auto takes the model's "
        "(sentence-transformers' 1_Pooling/config.json; else cls for an encoder, last token for a "
        "decoder), or mean, cls, last.",
    )
    normalize_embeddings: bool | None = Field(
        default=None,
        description="L2-normalize embeddings; unset = the model's (a sentence-transformers Normalize "
        "module; else on for a decoder, off for a bare encoder).",
    )
    lora_modules: Annotated[list[str], StringList] = Field(
        default_factory=list,
        description="LoRA adapters to serve, each name=path (a local PEFT folder: adapter_config.json + "
        'adapter_model.safetensors); requests pick one with "model": "<name>". Repeat the flag or '
        "separate with commas.",
    )
    cache_dir: Path = Field(
        default_factory=lambda: Path(DEFAULT_CACHE_DIR).expanduser(),
        description="Folder where pulled models are stored (models/ inside it). Also IZH_CACHE_DIR.",
    )

    @field_validator("cache_dir")
    @classmethod
    def _expand_cache_dir(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("lora_modules")
    @classmethod
    def _check_lora_modules(cls, value: list[str]) -> list[str]:
        names = [parse_lora_module(entry)[0] for entry in value]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"LoRA adapter names must be unique; repeated: {', '.join(duplicates)}")
        return value

    def lora_module_paths(self) -> tuple[tuple[str, str], ...]:
        """(name, absolute path) of each `lora_modules` entry."""
        pairs = (parse_lora_module(entry) for entry in self.lora_modules)
        return tuple((name, str(Path(path).expanduser().resolve())) for name, path in pairs)


class EngineSettings(_Section):
    """[engine]: the engine core: KV cache, scheduler, execution."""

    block_size: int = Field(default=16, gt=0, le=1024, description="Tokens per KV cache block.")
    kv_cache_memory_bytes: Annotated[int | None, ByteSize] = Field(
        default=None,
        gt=0,
        description="KV cache size, in bytes or with a unit (2GiB, 512MB); unset = derive it from "
        "kv_cache_memory_fraction.",
    )
    kv_cache_dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "q8_0"],
        CaseInsensitive,
    ] = Field(
        default="auto",
        description="Element format of the KV cache: auto (the model's dtype), float32, bfloat16, float16, "
        "fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2 (unscaled, clamped), or q8_0 (llama.cpp's: int8 per 32 values "
        "with a float16 scale, 34 bytes per 32). Smaller formats hold more tokens per GiB; attention reads "
        "them directly.",
    )
    kv_cache_memory_fraction: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="Fraction of free memory (device memory on GPU) given to the KV cache when "
        "kv_cache_memory_bytes is unset (on CPU at most 4 GiB).",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Token budget of one engine step (prefill chunks and decodes together); unset = 2048 "
        "on CUDA, 128 on CPU (where a 2048-token prefill step takes seconds, and every decode waits for it), "
        "2048 for an encoder (it only embeds: no decode waits).",
    )
    prefill_attention_budget: int | None = Field(
        default=None,
        ge=0,
        description="While other requests decode, the most (query token, context position) pairs the prefill "
        "chunks of one step attend to: a long prompt's chunks shrink as its context grows (a 128-token chunk "
        "at 4,000 tokens of context is 512,000 pairs), so that the decoding streams' steps stay short, at "
        "the cost of the long prompt's time to first token. 0 = no limit; unset = 32768 on CPU (131072 where "
        "attention over a bfloat16 cache runs on AVX512-BF16's vdpbf16ps, 196608 on the AMX tiles; there chunks "
        "also count 8192 or 4096 pairs a token), 0 on CUDA.",
    )
    max_num_seqs: int = Field(default=128, gt=0, description="Most sequences running in one engine step.")
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV cache of shared prompt prefixes across requests."
    )
    scheduling_policy: Annotated[Literal["fcfs", "priority"], CaseInsensitive] = Field(
        default="fcfs",
        description="Order of waiting requests: fcfs (arrival) or priority (the request's priority).",
    )
    seed: int = Field(
        default=0, ge=0, description="Seed of the engine's random generator (unseeded sampling)."
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Engine core processes under `izh serve`, each with its own KV cache, behind the same "
        'API; requests are routed by load and prompt-prefix affinity (docs/operations.md, "Scale out").',
    )
    num_threads: int | None = Field(
        default=None,
        gt=0,
        description="torch intra-op threads on CPU; unset = all cores offline, and under `izh serve` all "
        "but one when there are more than 2 (the API process streams on the spare core).",
    )
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs (always eager execution).")
    enable_lora: bool = Field(
        default=False,
        description="Give the model LoRA slots without --lora-modules (for adapters loaded at runtime); "
        "on whenever model.lora_modules is set or server.allow_runtime_lora_updating is on.",
    )
    max_loras: int = Field(
        default=4,
        gt=0,
        description="LoRA adapters resident at once: the running requests use at most this many; more "
        "can be loaded, the least recently used inactive one leaves its slot.",
    )
    max_lora_rank: int = Field(
        default=16, gt=0, description="The largest LoRA rank (r) an adapter may have (the slots' size)."
    )
    attention_backend: Annotated[Literal["auto", "torch_paged", "triton_paged"], CaseInsensitive] = Field(
        default="auto",
        description="Attention implementation: auto (triton_paged on CUDA with Triton, else torch_paged), "
        "torch_paged or triton_paged.",
    )
    cpu_kernels: Annotated[
        Literal["auto", "off", "generic", "avx2", "avx512", "amx", "neon"], BeforeValidator(parse_cpu_kernels)
    ] = Field(
        default="auto",
        description="izh's C kernels on CPU: auto (the best variant this CPU runs: amx, avx512, avx2 or "
        "generic; neon on ARM), a variant by name (an error when the CPU lacks its flags), or off (plain "
        "torch). Built with gcc on first use into <cache_dir>/kernels. Also IZH_CPU_KERNELS (0 = off).",
    )
    core_mode: Annotated[Literal["process", "thread"], CaseInsensitive] = Field(
        default="process",
        description="Run the engine core in a spawned process (default) or a thread of the API process "
        "(debugging).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        gt=0,
        description="Split the model over this many ranks (torch.distributed: gloo on CPU, NCCL on CUDA); "
        "it must divide the attention heads, KV heads and MLP width. On one host izh starts the other "
        "ranks itself; see docs/operations.md, 'Tensor parallel'.",
    )
    dist_init_addr: str | None = Field(
        default=None,
        pattern=r"^\S+:\d+$",
        description="HOST:PORT of rank 0's rendezvous for ranks on several hosts (every host passes the same); "
        "unset on one host (a free loopback port).",
    )
    nnodes: int = Field(
        default=1,
        gt=0,
        description="Hosts the tensor-parallel ranks run on (tensor_parallel_size / nnodes each).",
    )
    node_rank: int = Field(
        default=0,
        ge=0,
        description="This host's index among nnodes: 0 serves the API; the others run their ranks as workers "
        "of node 0 (`izh serve` with the same model and flags, only --node-rank differing).",
    )
    dist_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds a tensor-parallel collective or the rendezvous waits for a rank before the "
        "engine fails, naming it.",
    )


GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
"""The generation_config.json keys that are sampling defaults (and may be overridden)."""


def generation_config_override(text: str) -> dict[str, float]:
    """server.override_generation_config as a dict; ValueError naming what is wrong."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    for key, number in value.items():
        if key not in GENERATION_CONFIG_KEYS:
            raise ValueError(f"unknown key {key!r} (expected {', '.join(GENERATION_CONFIG_KEYS)})")
        if not isinstance(number, int | float) or isinstance(number, bool):
            raise ValueError(f"{key} must be a number")
    return value


class ServerSettings(_Section):
    """[server]: the HTTP API: binding, auth, limits, parsers."""

    host: str = Field(
        default="127.0.0.1", min_length=1, description="Address to bind; 0.0.0.0 listens on all."
    )
    port: int = Field(default=8000, ge=1, le=65535, description="TCP port to listen on.")
    api_keys: Annotated[list[SecretStr], StringList] = Field(
        default_factory=list,
        description="API keys accepted as 'Authorization: Bearer KEY'; empty = no auth. Secret: never "
        "printed. Env: a JSON list or comma-separated.",
    )
    allowed_origins: Annotated[list[str], StringList] = Field(
        default_factory=list, description="CORS origins allowed to call the API; empty = no CORS."
    )
    metrics_require_auth: bool = Field(default=False, description="Require an API key for /metrics as well.")
    allow_runtime_lora_updating: bool = Field(
        default=False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API keys, "
        "as every route): load and unload LoRA adapters from local folders at runtime.",
    )
    web_ui: bool = Field(
        default=True,
        description="Serve the built-in web UI: a chat page at / and a live dashboard at /dashboard (the "
        "pages are public; with API keys they ask for one before calling the API).",
    )
    max_body_bytes: Annotated[int, ByteSize] = Field(
        default=8 * 2**20, gt=0, description="Largest accepted request body, in bytes or with a unit (8MiB)."
    )
    max_requests_in_flight: int = Field(
        default=512, gt=0, description="Requests admitted at once; more are refused with 503 and Retry-After."
    )
    max_waiting_requests: int = Field(
        default=1024,
        ge=0,
        description="Requests allowed to wait in the engine queue before admission refuses.",
    )
    request_timeout_s: float | None = Field(
        default=None, gt=0, description="Per-request deadline in seconds; unset = no deadline."
    )
    drain_timeout_s: float = Field(
        default=30,
        ge=0,
        description="On shutdown, seconds to let in-flight requests finish before aborting them.",
    )
    sse_keepalive_s: float = Field(
        default=10,
        ge=0,
        description="Seconds between SSE keep-alive comments on an idle stream; 0 = none.",
    )
    tool_call_parser: str = Field(
        default="auto",
        min_length=1,
        description="Tool call parser: auto (from the chat template), none, or a parser name (hermes, "
        "llama3_json, mistral, qwen3_coder, pythonic, deepseek_v3, granite, phi4_mini_json, harmony / "
        "openai (gpt-oss)).",
    )
    chat_template: str | None = Field(
        default=None,
        description="A Jinja chat template file that replaces the model's (vLLM's --chat-template; or "
        "the template itself in one line), rendered in the same sandbox: every route and /tokenize use "
        "it, and tool_call_parser / reasoning_parser auto read it.",
    )
    reasoning_parser: str = Field(
        default="auto",
        min_length=1,
        description="Reasoning parser: auto (from the chat template), none, or a parser name (think, "
        "deepseek_r1, qwen3, harmony / openai_gptoss (gpt-oss's analysis channel)).",
    )
    override_generation_config: str | None = Field(
        default=None,
        description="vLLM's --override-generation-config: a JSON object over the model's "
        "generation_config.json sampling defaults (temperature, top_p, top_k, min_p, "
        'repetition_penalty, max_new_tokens), e.g. {"temperature": 0}; a request\'s own values win.',
    )

    @field_validator("override_generation_config")
    @classmethod
    def _check_generation_config(cls, value: str | None) -> str | None:
        if value is not None:
            generation_config_override(value)
        return value

    log_requests: bool = Field(
        default=True,
        description="Log one line per API request: request id, key id, status, token counts, timings, "
        "finish reason (never the key, the prompt or the output).",
    )
    log_prompts: bool = Field(
        default=False,
        description="Also log each request's prompts and outputs (off: they may hold personal data).",
    )
    engine_heartbeat_timeout_s: float = Field(
        default=30,
        gt=0,
        description="Seconds the engine core process may go without answering a heartbeat (its input "
        "thread answers, during a step too) before it is declared hung: /ready turns red, then "
        "in-flight requests fail.",
    )
    engine_step_timeout_s: float = Field(
        default=600,
        ge=0,
        description="Seconds one engine step may run before the core is declared hung (0: no bound). A "
        "step holds at most engine.max_num_batched_tokens tokens; raise it for a big model on a slow "
        "CPU.",
    )
    restart_dead_core: bool = Field(
        default=False,
        description="When the engine core dies or hangs, start a new one (in-flight requests fail, new "
        "ones wait for it) instead of exiting with status 1 for a supervisor to restart the server.",
    )
    responses_store_max: int = Field(
        default=1024,
        ge=0,
        description="Responses kept for previous_response_id and GET /v1/responses/{id} (in memory, "
        "least recently used evicted first; 0 stores none).",
    )
    cache_salt_per_key: bool = Field(
        default=True,
        description="With API keys, give each key its own prefix cache namespace, so that no tenant can "
        "probe another's prompts through cache-hit timing (off: all keys share cached prefixes).",
    )
    max_buffered_outputs: int = Field(
        default=1024,
        gt=0,
        description="Step outputs a slow client may leave unread before its request is aborted.",
    )
    max_connections: int | None = Field(
        default=4096,
        gt=0,
        description="Open connections (and requests) at once; more are answered 503 by the HTTP server. "
        "Unset = no limit.",
    )
    timeout_keep_alive_s: int = Field(
        default=5, gt=0, description="Seconds an idle keep-alive connection stays open between requests."
    )
    header_timeout_s: float = Field(
        default=10,
        gt=0,
        description="Seconds a connection may take to send a complete request head; a slower or silent "
        "one is closed (slowloris).",
    )
    body_timeout_s: float = Field(
        default=30,
        gt=0,
        description="Seconds a client may take to send a request body; slower is a 408.",
    )
    api_server_count: int = Field(
        default=1,
        ge=1,
        le=64,
        description="API processes under `izh serve`, sharing the port and the engine core(s): "
        'tokenizing and streaming for many clients on more CPU cores (docs/operations.md, "Scale out").',
    )

    def api_key_values(self) -> frozenset[str]:
        """The accepted API keys in clear, for the auth check only (never log them)."""
        return frozenset(key.get_secret_value() for key in self.api_keys)


class LimitSettings(_Section):
    """[limits]: bounds on what one API request may ask for; a violation is a 400 naming the limit."""

    max_json_depth: int = Field(
        default=64, gt=0, le=1000, description="Deepest nesting of arrays and objects in a request body."
    )
    max_messages: int = Field(default=1024, gt=0, description="Most messages in one chat request.")
    max_prompts: int = Field(
        default=256, gt=0, description="Most prompts in one (batched) completion request."
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Longest prompt (or embedding input) in tokens; unset = the model's context length.",
    )
    max_embedding_inputs: int = Field(
        default=2048, gt=0, description="Most inputs in one /v1/embeddings request (OpenAI's limit: 2048)."
    )
    max_output_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Largest max_tokens (max_completion_tokens) a request may ask for; unset = the "
        "model's context length.",
    )
    max_n: int = Field(default=128, gt=0, le=128, description="Largest n (choices per prompt).")
    max_stop: int = Field(default=16, ge=0, description="Most stop strings in one request.")
    max_stop_chars: int = Field(default=256, gt=0, description="Longest stop string, in characters.")
    max_stop_token_ids: int = Field(default=256, ge=0, description="Most stop_token_ids in one request.")
    max_logit_bias: int = Field(default=1024, ge=0, description="Most logit_bias entries in one request.")
    max_top_logprobs: int = Field(
        default=20,
        ge=0,
        le=20,
        description="Largest top_logprobs, logprobs (completions) and prompt_logprobs.",
    )
    max_tools: int = Field(default=128, ge=0, description="Most tools in one chat request.")
    strict_tools: bool = Field(
        default=False,
        description="Refuse (400) a Responses request offering tools izh cannot run (web_search, "
        "file_search, code_interpreter, ...); off, they are skipped, logged and named in the "
        "x-izh-skipped-tools response header.",
    )
    max_schema_bytes: Annotated[int, ByteSize] = Field(
        default=64 * 2**10,
        gt=0,
        description="Largest JSON schema (response_format, structured_outputs, guided_json, a tool's "
        "parameters) or choice list, as JSON text; bytes or with a unit (64KiB).",
    )
    max_schema_depth: int = Field(default=32, gt=0, description="Deepest nesting of a JSON schema.")
    max_regex_chars: int = Field(default=4096, gt=0, description="Longest regex constraint, in characters.")
    max_grammar_chars: int = Field(
        default=64 * 2**10, gt=0, description="Longest grammar constraint, in characters."
    )
    max_chat_template_chars: int = Field(
        default=64 * 2**10, gt=0, description="Longest chat template a request may send, in characters."
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="Accept a chat template sent in a request (it runs sandboxed, but can still burn CPU); "
        "off = only the model's own templates, by name.",
    )
    max_images_per_request: int = Field(
        default=8, ge=0, description="Most images (image_url parts) in one chat request (a VLM only)."
    )
    max_image_bytes: Annotated[int, ByteSize] = Field(
        default=10 * 2**20,
        gt=0,
        description="Largest image file, decoded from its data URL or downloaded; bytes or with a unit "
        "(10MiB). A data URL also counts against server.max_body_bytes.",
    )
    max_image_pixels: int = Field(
        default=4096 * 4096,
        gt=0,
        description="Largest image, in pixels (width x height), checked before decoding.",
    )
    allow_remote_images: bool = Field(
        default=False,
        description="Fetch image_url parts given as http(s) URLs (off: only data: URLs). The server then "
        "makes requests to any address a client names: turn it on only for trusted clients.",
    )
    remote_image_timeout_s: float = Field(
        default=10.0, gt=0, description="The longest a remote image's download may take, in seconds."
    )


@dataclass(frozen=True, slots=True)
class KeyRateLimit:
    """The limits of one API key; None = unlimited."""

    tokens_per_minute: int | None
    burst_tokens: int | None
    """The bucket's size: tokens a key may spend at once after being idle (None: tokens_per_minute)."""
    max_concurrent_requests: int | None


_KEY_RATE_LIMIT_FIELDS = ("tokens_per_minute", "burst_tokens", "max_concurrent_requests")


def parse_key_rate_limit(text: str) -> tuple[str, dict[str, int]]:
    """Split "KEY_ID name=value ..." (a rate_limits.per_key entry) into the key id and its values."""
    key_id, *pairs = text.split()
    if "=" in key_id:
        raise ValueError(f"{text!r} must start with a key id, e.g. '3f2a9c1b tokens_per_minute=60000'")
    values: dict[str, int] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in _KEY_RATE_LIMIT_FIELDS:
            raise ValueError(f"{pair!r} in {text!r}: expected one of {', '.join(_KEY_RATE_LIMIT_FIELDS)}=N")
        if not raw.isdigit() or int(raw) <= 0:
            raise ValueError(f"{pair!r} in {text!r}: the value must be a positive integer")
        values[name] = int(raw)
    if not values:
        raise ValueError(f"{text!r} sets no limit; add e.g. tokens_per_minute=60000")
    return key_id, values


def _check_key_rate_limits(entries: list[str]) -> list[str]:
    seen: set[str] = set()
    for entry in entries:
        key_id, _ = parse_key_rate_limit(entry)
        if key_id in seen:
            raise ValueError(f"key id {key_id!r} has two entries")
        seen.add(key_id)
    return entries


class RateLimitSettings(_Section):
    """[rate_limits]: per API key token buckets (prompt + max_tokens) and concurrency."""

    tokens_per_minute: int | None = Field(
        default=None,
        gt=0,
        description="Tokens (prompt + completion) each API key may use per minute; unset = unlimited. "
        "Without API keys it bounds all clients together.",
    )
    burst_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Tokens a key may spend at once after being idle (the bucket size); unset = "
        "tokens_per_minute.",
    )
    max_concurrent_requests: int | None = Field(
        default=None, gt=0, description="Generation requests one key may have in flight; unset = unlimited."
    )
    per_key: Annotated[list[str], StringList, AfterValidator(_check_key_rate_limits)] = Field(
        default_factory=list,
        description="Limits of one key, overriding the ones above: 'KEY_ID tokens_per_minute=N "
        "burst_tokens=N max_concurrent_requests=N' (any of the three). The key id is the first 8 hex "
        "digits of the key's SHA-256 (`izh serve` logs each key's id).",
    )

    def default_limit(self) -> KeyRateLimit:
        return KeyRateLimit(self.tokens_per_minute, self.burst_tokens, self.max_concurrent_requests)

    def key_limits(self) -> dict[str, KeyRateLimit]:
        """The per_key entries by key id, each completed with the section's defaults."""
        limits = {}
        for entry in self.per_key:
            key_id, values = parse_key_rate_limit(entry)
            limits[key_id] = dataclasses.replace(self.default_limit(), **values)
        return limits


class LoggingSettings(_Section):
    """[logging]: log level and format."""

    level: Annotated[Literal["debug", "info", "warning", "error", "critical"], CaseInsensitive] = Field(
        default="info", description="Lowest level logged."
    )
    # `json` would shadow BaseModel.json, so the attribute is json_format and the key stays "json".
    json_format: bool = Field(default=False, alias="json", description="Log one JSON object per line.")


class SpeculativeSettings(_Section):
    """[speculative]: speculative decoding (vLLM's --speculative-config): drafts proposed each step and
    verified by one batched step of the model, with exactly the tokens it would give without them."""

    config: str | None = Field(
        default=None,
        description="vLLM's --speculative-config: a JSON object of this section's keys, e.g. {\"method\": "
        '"ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5}; its keys override the others.',
    )
    method: Annotated[Literal["ngram", "draft_model"] | None, CaseInsensitive] = Field(
        default=None,
        description="How drafts are proposed: ngram (prompt lookup over the prompt and the output so far) or "
        "draft_model (a smaller model of the same tokenizer, `model`); unset = speculative decoding off.",
    )
    model: str | None = Field(
        default=None,
        description="draft_model: the draft model, a .gguf file, a Hugging Face folder or a pulled registry "
        "name, sharing the served model's tokenizer (refused at start otherwise). Its KV cache shares the "
        "served model's block tables and budget (engine.kv_cache_memory_bytes holds both).",
    )
    num_speculative_tokens: int = Field(default=5, gt=0, le=32, description="Draft tokens per step.")
    draft_p_min: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="draft_model: a request stops drafting for the step at a draft the draft model gives less "
        "than this probability (llama.cpp's --draft-p-min: fewer drafts likely rejected); 0 = always "
        "num_speculative_tokens.",
    )
    prompt_lookup_min: int = Field(
        default=2,
        gt=0,
        description="ngram: the shortest suffix of the tokens an earlier occurrence must match.",
    )
    prompt_lookup_max: int = Field(
        default=5, gt=0, description="ngram: the longest suffix tried (longest first)."
    )
    disable_by_batch_size: int | None = Field(
        default=4,
        ge=0,
        description="Drafting pauses while more requests than this run (verifying drafts costs compute "
        "a big batch needs more); unset = never.",
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_config(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("config") is None:
            return data
        text = data["config"]
        try:
            parsed = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as exc:
            raise ValueError(f"config is not valid JSON ({exc.msg})") from exc
        if not isinstance(parsed, dict):
            raise ValueError("config must be a JSON object")
        unknown = sorted(set(parsed) - (set(cls.model_fields) - {"config"}))
        if unknown:
            raise ValueError(f"config: unknown key(s) {', '.join(unknown)}")
        return {**data, **parsed, "config": None}

    @model_validator(mode="after")
    def _check_lookup(self) -> SpeculativeSettings:
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs model (the draft model's path)")
        if self.method != "draft_model" and (self.model or self.draft_p_min):
            raise ValueError(f"model and draft_p_min are the draft_model method's; method is {self.method}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min} > prompt_lookup_max {self.prompt_lookup_max}"
            )
        return self

    def to_config(self) -> SpeculativeConfig | None:
        """The engine's SpeculativeConfig; None when no method is set."""
        from izh.config import SpeculativeConfig

        if self.method is None:
            return None
        return SpeculativeConfig(
            method=self.method,
            model=self.model,
            draft_p_min=self.draft_p_min,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
            disable_by_batch_size=self.disable_by_batch_size,
        )


class IzhSettings(BaseSettings):
    """All settings, one section per TOML table. Build it with :func:`load_settings`.

    ``IzhSettings(**values)`` validates the given values only: the layering of file, environment and
    flags lives in :func:`load_settings`, which can then name the source of a bad value.
    """

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    model: ModelSettings = Field(default_factory=lambda: ModelSettings(), description="[model] section.")
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings(), description="[engine] section.")
    server: ServerSettings = Field(default_factory=lambda: ServerSettings(), description="[server] section.")
    limits: LimitSettings = Field(default_factory=lambda: LimitSettings(), description="[limits] section.")
    rate_limits: RateLimitSettings = Field(
        default_factory=lambda: RateLimitSettings(), description="[rate_limits] section."
    )
    logging: LoggingSettings = Field(
        default_factory=lambda: LoggingSettings(), description="[logging] section."
    )
    speculative: SpeculativeSettings = Field(
        default_factory=lambda: SpeculativeSettings(), description="[speculative] section."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Only explicit values: load_settings has already merged file, environment and flags, and
        # reading os.environ here again would bypass its source tracking and unknown-key checks.
        return (init_settings,)

    def to_engine_config(self, model_path: str) -> EngineConfig:
        """The frozen EngineConfig for the core; ``model_path`` is the resolved local file or folder."""
        from izh.config import EngineConfig

        model, engine = self.model, self.engine
        return EngineConfig(
            model=model_path,
            served_model_name=self.served_model_name,
            dtype=model.dtype,
            quantization=model.quantization,
            device=model.device,
            max_model_len=model.max_model_len,
            block_size=engine.block_size,
            kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
            kv_cache_memory_fraction=engine.kv_cache_memory_fraction,
            kv_cache_dtype=engine.kv_cache_dtype,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            prefill_attention_budget=engine.prefill_attention_budget,
            max_num_seqs=engine.max_num_seqs,
            enable_prefix_caching=engine.enable_prefix_caching,
            scheduling_policy=engine.scheduling_policy,
            seed=engine.seed,
            num_threads=engine.num_threads,
            enforce_eager=engine.enforce_eager,
            attention_backend=engine.attention_backend,
            cpu_kernels=engine.cpu_kernels,
            pooling=model.pooling,
            normalize_embeddings=model.normalize_embeddings,
            lora_modules=model.lora_module_paths(),
            enable_lora=engine.enable_lora or self.server.allow_runtime_lora_updating,
            max_loras=engine.max_loras,
            max_lora_rank=engine.max_lora_rank,
            cache_dir=str(model.cache_dir),
            tensor_parallel_size=engine.tensor_parallel_size,
            dist_init_addr=engine.dist_init_addr,
            nnodes=engine.nnodes,
            node_rank=engine.node_rank,
            dist_timeout_s=engine.dist_timeout_s,
            speculative=self.speculative.to_config(),
        )

    @property
    def served_model_name(self) -> str:
        """The name the API reports: model.served_model_name, else model.name."""
        return self.model.served_model_name or self.model.name

    def to_display_dict(self) -> dict[str, dict[str, Any]]:
        """JSON-ready values keyed like the TOML file, with API keys masked (safe to print or log)."""
        data = self.model_dump(mode="json", by_alias=True)
        return {section: dict(values) for section, values in data.items()}


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSettings,
    "engine": EngineSettings,
    "server": ServerSettings,
    "limits": LimitSettings,
    "rate_limits": RateLimitSettings,
    "logging": LoggingSettings,
    "speculative": SpeculativeSettings,
}


def _section_keys(section: type[_Section]) -> dict[str, FieldInfo]:
    """Field infos keyed by their TOML/env key (the alias when there is one)."""
    return {info.alias or name: info for name, info in section.model_fields.items()}


def iter_setting_fields() -> Iterator[tuple[str, FieldInfo]]:
    """Every setting as (dotted key, field info), in declaration order."""
    for section_name, section in SECTIONS.items():
        for key, info in _section_keys(section).items():
            yield f"{section_name}.{key}", info


_ALL_FIELDS: dict[str, FieldInfo] = dict(iter_setting_fields())


# ---------------------------------------------------------------------------------------------------
# Layering: each source yields dotted values plus where each came from


@dataclass(slots=True)
class _Layer:
    """Values from one source, flat by dotted key, with a human description of each value's origin."""

    values: dict[str, Any]
    origins: dict[str, str]


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _file_layer(config_file: str | Path) -> _Layer:
    path = Path(config_file).expanduser()
    where = f"config file {config_file}"
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"{where}: not found") from None
    except IsADirectoryError:
        raise SettingsError(f"{where}: is a folder, not a TOML file") from None
    except OSError as exc:
        raise SettingsError(f"{where}: cannot be read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{where}: invalid TOML: {exc}") from None
    layer = _Layer({}, {})
    for section_name, table in data.items():
        if section_name not in SECTIONS:
            hint = _did_you_mean(section_name, list(SECTIONS))
            raise SettingsError(
                f"{where}: unknown section [{section_name}]{hint}; known: {', '.join(SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise SettingsError(f"{where}: {section_name} must be a table ([{section_name}])")
        keys = _section_keys(SECTIONS[section_name])
        for key, value in table.items():
            if key not in keys:
                raise SettingsError(
                    f"{where}: unknown key {section_name}.{key}{_did_you_mean(key, list(keys))}"
                )
            dotted = f"{section_name}.{key}"
            layer.values[dotted] = value
            layer.origins[dotted] = f"from {where}"
    return layer


def _allows_none(info: FieldInfo) -> bool:
    return type(None) in get_args(info.annotation)


def _env_var_to_dotted(var: str) -> str | None:
    """The dotted key an IZH_* variable sets, None when it is not a settings variable.

    Raises SettingsError for IZH_<KNOWN SECTION>__<UNKNOWN FIELD>: a typo must not be ignored.
    """
    if var in _ENV_SHORTCUTS:
        return _ENV_SHORTCUTS[var]
    if not var.startswith(ENV_PREFIX):
        return None
    section_name, sep, key = var[len(ENV_PREFIX) :].partition(ENV_NESTED_DELIMITER)
    section_name, key = section_name.lower(), key.lower()
    if not sep or section_name not in SECTIONS:
        return None
    keys = list(_section_keys(SECTIONS[section_name]))
    if key not in keys:
        raise SettingsError(
            f"environment variable {var}: [{section_name}] has no setting {key!r}{_did_you_mean(key, keys)}"
        )
    return f"{section_name}.{key}"


def _env_layer(env: Mapping[str, str]) -> _Layer:
    layer = _Layer({}, {})
    # Shortcuts first, so that the explicit nested variable overrides them.
    names = sorted(env, key=lambda var: (var not in _ENV_SHORTCUTS, var))
    for var in names:
        dotted = _env_var_to_dotted(var)
        if dotted is None:
            continue
        raw = env[var]
        value: Any = raw
        if raw.strip().lower() in _NONE_WORDS and _allows_none(_ALL_FIELDS[dotted]):
            value = None
        layer.values[dotted] = value
        layer.origins[dotted] = f"from environment variable {var}"
    return layer


def _override_origin(dotted: str) -> str:
    if dotted == "model.name":
        return "from argument MODEL"
    spec = _SPECS_BY_DOTTED.get(dotted)
    return f"from flag {spec.flag}" if spec else f"from override {dotted}"


def _override_layer(overrides: Mapping[str, Any]) -> _Layer:
    layer = _Layer({}, {})
    for dotted, value in overrides.items():
        if dotted not in _ALL_FIELDS:
            raise SettingsError(f"unknown setting {dotted}{_did_you_mean(dotted, list(_ALL_FIELDS))}")
        layer.values[dotted] = value
        layer.origins[dotted] = _override_origin(dotted)
    return layer


def _nest(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section_name, _, key = dotted.partition(".")
        nested.setdefault(section_name, {})[key] = value
    return nested


def _show_value(value: Any, dotted: str, origin: str) -> str:
    info = _ALL_FIELDS.get(dotted)
    if info is not None and _is_secret(info):
        return _MASK
    if isinstance(value, str) and origin.startswith("from environment"):
        return value  # shown exactly as typed in the environment
    return repr(value)


def _error_from_validation(exc: ValidationError, origins: Mapping[str, str]) -> SettingsError:
    errors = exc.errors()
    first = errors[0]
    loc = first["loc"]
    dotted = ".".join(str(part) for part in loc[:2])
    shown = dotted + "".join(f"[{part}]" for part in loc[2:])
    origin = origins.get(dotted, "the default")
    message = first["msg"].removeprefix("Value error, ")
    more = f" [+{len(errors) - 1} more]" if len(errors) > 1 else ""
    got = _show_value(first.get("input"), dotted, origin)
    return SettingsError(f"{shown or 'settings'}: {message} (got {got}, {origin}){more}")


def load_settings(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> IzhSettings:
    """Resolve settings: defaults < ``config_file`` (TOML) < ``env`` (IZH_*) < ``overrides`` (flags).

    ``env`` defaults to ``os.environ``; ``overrides`` are keyed by dotted name
    (``{"engine.max_num_seqs": 64}``). Raises SettingsError (one line: field, value, source) on a
    missing or unparsable file, an unknown key or variable, or an invalid value.
    """
    layers = []
    if config_file is not None:
        layers.append(_file_layer(config_file))
    layers.append(_env_layer(os.environ if env is None else env))
    layers.append(_override_layer(overrides or {}))
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for layer in layers:
        values.update(layer.values)
        origins.update(layer.origins)
    try:
        settings = IzhSettings(**cast(dict[str, Any], _nest(values)))
    except ValidationError as exc:
        raise _error_from_validation(exc, origins) from None
    logger.debug("settings resolved from %s", sorted(set(origins.values())) or "defaults")
    return settings


def env_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """model.cache_dir from the environment alone, for code that has no IzhSettings (the offline LLM).

    IZH_MODEL__CACHE_DIR, else IZH_CACHE_DIR, else ~/.cache/izh; other variables are not looked at.
    """
    source = os.environ if env is None else env
    raw = source.get("IZH_MODEL__CACHE_DIR") or source.get("IZH_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(raw).expanduser()


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """torchrun's rendezvous variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when this
    process was started by torchrun (RANK and WORLD_SIZE set), for izh.config.with_torchrun_env; else
    None. Raises SettingsError when one is missing or not a number."""
    source = os.environ if env is None else env
    if "RANK" not in source or "WORLD_SIZE" not in source:
        return None
    found = {var: source[var] for var in TORCHRUN_VARS if var in source}
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if var not in found]
    if missing:
        raise SettingsError(f"torchrun environment: RANK and WORLD_SIZE are set but not {', '.join(missing)}")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if var in found and not found[var].isdigit():
            raise SettingsError(f"torchrun environment: {var}={found[var]!r} is not a number")
    return found


def env_cpu_kernels(env: Mapping[str, str] | None = None) -> str:
    """engine.cpu_kernels from the environment alone, for code that has no IzhSettings (the offline LLM).

    IZH_ENGINE__CPU_KERNELS, else IZH_CPU_KERNELS (0 = off), else auto. Raises SettingsError for a value
    that is not a choice."""
    source = os.environ if env is None else env
    for var in ("IZH_ENGINE__CPU_KERNELS", "IZH_CPU_KERNELS"):
        raw = source.get(var)
        if raw is not None and raw.strip():
            value = parse_cpu_kernels(raw)
            if value not in CPU_KERNEL_CHOICES:
                raise SettingsError(
                    f"engine.cpu_kernels: expected one of {', '.join(CPU_KERNEL_CHOICES)} (got {raw}, "
                    f"from environment variable {var})"
                )
            return str(value)
    return "auto"


# ---------------------------------------------------------------------------------------------------
# Flag specs: one command-line flag per field, generated from the model


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """How one setting appears on the command line."""

    dotted: str
    """Dotted setting key, e.g. "engine.max_num_seqs"."""
    flag: str
    """Long flag, e.g. "--max-num-seqs"; booleans also accept "--no-" + the same name."""
    python_type: type
    """Type the command line parses: int, float, bool or str (sizes stay str: "2GiB")."""
    description: str
    choices: tuple[str, ...] | None
    """Allowed values of an enum-like field, else None."""
    multiple: bool
    """A list field: the flag is repeatable and each use adds one item."""
    default: Any
    """The built-in default (for help text); None for secrets and unset optionals."""
    secret: bool
    byte_size: bool
    """A size in bytes that also accepts units ("2GiB"), hence parsed as str."""

    @property
    def section(self) -> str:
        return self.dotted.partition(".")[0]

    @property
    def param_name(self) -> str:
        """A Python identifier for this flag's parameter, unique across settings."""
        return "setting__" + self.dotted.replace(".", "__")


# Flags that deviate from the field-name rule (see the module docstring).
_FLAG_NAMES: dict[str, str] = {
    "server.api_keys": "--api-key",
    "server.allowed_origins": "--allowed-origin",
    "rate_limits.per_key": "--rate-limit",
    "logging.level": "--log-level",
    "speculative.config": "--speculative-config",
    "speculative.method": "--speculative-method",
    "speculative.model": "--speculative-model",
    "speculative.disable_by_batch_size": "--speculative-disable-by-batch-size",
    "logging.json": "--log-json",
}
_NO_FLAG = frozenset({"model.name"})


def _is_secret(info: FieldInfo) -> bool:
    annotation = info.annotation
    return annotation is SecretStr or SecretStr in get_args(annotation)


def _is_byte_size(info: FieldInfo) -> bool:
    return any(isinstance(meta, BeforeValidator) and meta.func is parse_byte_size for meta in info.metadata)


def _non_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _cli_type(info: FieldInfo) -> tuple[type, tuple[str, ...] | None, bool]:
    """(python type, choices, multiple) of a field as the command line sees it."""
    annotation = _non_none(info.annotation)
    origin = get_origin(annotation)
    if origin is Literal:
        return str, tuple(str(arg) for arg in get_args(annotation)), False
    if origin is list:
        return str, None, True
    if _is_byte_size(info) or annotation in (str, Path, SecretStr):
        return str, None, False
    if annotation in (bool, int, float):
        return annotation, None, False
    raise TypeError(f"no command-line type for setting annotation {annotation!r}")  # a new field type


def _default_of(info: FieldInfo) -> Any:
    if _is_secret(info):
        return None
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def _build_flag_specs() -> tuple[FlagSpec, ...]:
    names_by_key: dict[str, int] = {}
    for dotted in _ALL_FIELDS:
        key = dotted.partition(".")[2]
        names_by_key[key] = names_by_key.get(key, 0) + 1
    specs = []
    for dotted, info in _ALL_FIELDS.items():
        if dotted in _NO_FLAG:
            continue
        section_name, _, key = dotted.partition(".")
        flat = key if names_by_key[key] == 1 else f"{section_name}_{key}"
        python_type, choices, multiple = _cli_type(info)
        specs.append(
            FlagSpec(
                dotted=dotted,
                flag=_FLAG_NAMES.get(dotted, "--" + flat.replace("_", "-")),
                python_type=python_type,
                description=info.description or "",
                choices=choices,
                multiple=multiple,
                default=_default_of(info),
                secret=_is_secret(info),
                byte_size=_is_byte_size(info),
            )
        )
    return tuple(specs)


_SPECS: tuple[FlagSpec, ...] = _build_flag_specs()
_SPECS_BY_DOTTED: dict[str, FlagSpec] = {spec.dotted: spec for spec in _SPECS}


def settings_flag_specs() -> tuple[FlagSpec, ...]:
    """One FlagSpec per setting that has a flag (every field but model.name), in declaration order."""
    return _SPECS


def export_prometheus_multiproc_dir(path: str) -> None:
    """Point prometheus-client's multiprocess mode at `path` for the processes started from now on
    (`izh serve --api-server-count N`; read when they import prometheus_client)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
