"""LLM: offline, synchronous generation over an in-process EngineCore (mirrors vLLM's `LLM`)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from izh.config import EngineConfig
from izh.engine.core import EngineCore
from izh.errors import InvalidRequest, LoraAdapterError
from izh.frontend.input_processor import ModelFacts, process_request
from izh.frontend.output_processor import OutputProcessor, PositionLogprobs, RequestState
from izh.pooling_params import PoolingParams, cosine, embedding_floats, score_params
from izh.sampling_params import SamplingParams
from izh.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]
"""A string, or {"prompt_token_ids": [...]} (optionally with "prompt": the text it came from)."""

ProgressFn = Callable[[int, int, str], None]
"""progress(done, total, phase), phase `LOADING_WEIGHTS` or `GENERATING` (the shape of izh.hub's)."""

LOADING_WEIGHTS = "loading weights"
"""Phase of LLM(): done and total count the checkpoint tensors copied into the model."""
GENERATING = "generating"
"""Phase of each generate() / chat() call: done and total count its finished requests (from 0)."""


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (n > 1 gives several, by index)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt: its ids, and one CompletionOutput per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """The embedding of one input (vLLM's `EmbeddingRequestOutput`, its `outputs.embedding` flattened)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float] = field(default_factory=list)


@dataclass(slots=True)
class ScoringRequestOutput:
    """The score of one pair (vLLM's `ScoringRequestOutput`, its `outputs.score` flattened)."""

    request_id: str
    prompt_token_ids: list[int]
    """The pair's tokens (a cross-encoder's one sequence; for an embedding model, text_2's)."""
    score: float


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    `model` is a registry name ("smollm2"), a .gguf file or a Hugging Face folder; the keyword
    arguments are EngineConfig fields (dtype, max_model_len, kv_cache_memory_bytes, block_size,
    max_num_batched_tokens, max_num_seqs, enable_prefix_caching, scheduling_policy, seed, ...).

    LoRA: `lora_modules={"name": "/path/to/peft-folder", ...}` loads adapters at start (`max_loras`,
    `max_lora_rank`, `enable_lora` as in EngineConfig); `generate(..., lora_name=...)` picks one per call
    or per prompt.

    `progress` hears how loading and each generate() call advance (`ProgressFn`); the library itself
    never draws on the console (izh_cli.progress.ProgressBar draws these as Rich bars).
    """

    def __init__(
        self,
        model: str = "smollm2",
        *,
        cache_dir: str | Path | None = None,
        progress: ProgressFn | None = None,
        **engine_kwargs: Any,
    ) -> None:
        from izh.hub import default_cache_dir, resolve_model

        cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.model_path = str(resolve_model(model, cache))
        engine_kwargs.setdefault("served_model_name", model)
        engine_kwargs.setdefault("cache_dir", str(cache))  # the C kernels go to <cache>/kernels
        lora_modules = engine_kwargs.get("lora_modules")
        if isinstance(lora_modules, Mapping):
            engine_kwargs["lora_modules"] = tuple((str(k), str(v)) for k, v in lora_modules.items())
        self.config = EngineConfig(model=self.model_path, **engine_kwargs)
        self.progress = progress
        self.engine_core = EngineCore(self.config, progress=_in_phase(progress, LOADING_WEIGHTS))
        self.tokenizer = self.engine_core.tokenizer  # one tokenizer in the process, the core's
        self._processor = OutputProcessor(self.tokenizer)
        self._states: dict[str, RequestState] = {}
        self._counter = itertools.count()
        info = self.engine_core.embedding_info()
        self._model_facts = ModelFacts(
            model_name=model,
            vocab_size=self.engine_core.vocab_size,
            max_model_len=self.engine_core.max_model_len,
            can_generate=info["can_generate"],
            pooling_task=info["pooling_task"],
            hidden_size=info["hidden_size"],
            matryoshka_dimensions=info["matryoshka_dimensions"],
            # A VLM: images are served over HTTP only (izh serve); a prompt may not hold their placeholder.
            image_token_id=self.engine_core.runner.image_token_id,
        )

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter at `path` as `name` (LoraAdapterError when it cannot be served)."""
        result = self.engine_core.load_lora_adapter(name, path)
        if "error" in result:
            raise LoraAdapterError(result["error"], param="lora_path")

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    # --- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns the outputs in prompt order. `lora_name`: the LoRA adapter
        of every prompt, or one per prompt (None: the base model)."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params_list = self._broadcast_params(sampling_params, len(prompt_list))
        if lora_name is None or isinstance(lora_name, str):
            lora_names: list[str | None] = [lora_name] * len(prompt_list)
        else:
            lora_names = list(lora_name)
            if len(lora_names) != len(prompt_list):
                raise ValueError(f"{len(lora_names)} lora names for {len(prompt_list)} prompts")
        results: dict[str, RequestOutput] = {}
        children: dict[str, tuple[RequestOutput, int]] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                text, token_ids = self._tokenize_prompt(prompt)
                request_id = str(next(self._counter))
                results[request_id] = RequestOutput(
                    request_id=request_id,
                    prompt=text,
                    prompt_token_ids=token_ids,
                    outputs=[CompletionOutput(index=k) for k in range(params.n)],
                )
                for k in range(params.n):
                    child_id = request_id if params.n == 1 else f"{request_id}-{k}"
                    self._add_request(
                        child_id,
                        token_ids,
                        params.child(k),
                        priority[i] if priority else 0,
                        lora_name=lora_names[i],
                    )
                    children[child_id] = (results[request_id], k)
        except BaseException:
            # One bad prompt fails the call; what was already queued must not linger in the engine.
            self.engine_core.abort_requests(list(children))
            for child_id in children:
                self._states.pop(child_id, None)
            raise
        self._run(children)
        return list(results.values())

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_name: str | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate (with the LoRA adapter
        `lora_name`, if given)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                conversation,  # type: ignore[arg-type]
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The template already holds the special tokens (BOS included where the model wants it).
        token_prompts: list[PromptType] = [
            {"prompt": p, "prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)}
            for p in prompts
        ]
        return self.generate(token_prompts, sampling_params, lora_name=lora_name)

    def embed(
        self,
        inputs: PromptType | Sequence[PromptType],
        *,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per input (like vLLM's `LLM.embed`), in input order, over the same engine
        path as the server's /v1/embeddings: the model's pooling and normalization, `dimensions` only
        where the model declares Matryoshka sizes. Inputs are strings (tokenized with the special
        tokens) or {"prompt_token_ids": [...]}."""
        info = self.engine_core.embedding_info()
        pooling = PoolingParams(
            pooling_type=info["pooling_type"], normalize=info["normalize_embeddings"], dimensions=dimensions
        )
        input_list = [inputs] if isinstance(inputs, str | dict) else list(inputs)
        token_ids = [self._tokenize_prompt(prompt)[1] for prompt in input_list]
        pooled = self._pool(token_ids, [pooling] * len(token_ids))
        return [EmbeddingRequestOutput(request_id, ids, vector) for request_id, ids, vector in pooled]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[ScoringRequestOutput]:
        """The relevance of text_1 to each text_2 (like vLLM's `LLM.score`; one text_1 against every
        text_2, or item by item), as the server's /score computes it: a cross-encoder's score of each
        pair (sentence-transformers' `CrossEncoder.predict`), or an embedding model's cosine of the
        two embeddings. InvalidRequest for a generative model or mismatched lengths."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if not first or not second or (len(first) != 1 and len(first) != len(second)):
            raise InvalidRequest(
                f"give one text_1, or as many as text_2 (got {len(first)} and {len(second)})", param="text_2"
            )
        lefts = first if len(first) > 1 else first * len(second)
        info = self.engine_core.embedding_info()
        if info["pooling_task"] == "score":
            encoded = [self.tokenizer.encode_pair(a, b) for a, b in zip(lefts, second, strict=True)]
            pooled = self._pool([ids for ids, _ in encoded], [score_params(start) for _, start in encoded])
            return [ScoringRequestOutput(request_id, ids, values[0]) for request_id, ids, values in pooled]
        if info["can_generate"]:
            raise InvalidRequest(
                "this model generates text: score needs a cross-encoder or an embedding model", param="model"
            )
        vectors = self.embed([*first, *second])
        left, right = vectors[: len(first)], vectors[len(first) :]
        return [
            ScoringRequestOutput(
                out.request_id,
                out.prompt_token_ids,
                cosine(left[0 if len(left) == 1 else i].embedding, out.embedding),
            )
            for i, out in enumerate(right)
        ]

    def _pool(
        self, token_ids: list[list[int]], poolings: list[PoolingParams]
    ) -> list[tuple[str, list[int], list[float]]]:
        """Each prompt's (request id, ids, pooled floats), in order: one pooling request per prompt."""
        results: dict[str, tuple[list[int], list[float]]] = {}
        try:
            for ids, pooling in zip(token_ids, poolings, strict=True):
                request_id = str(next(self._counter))
                self._add_request(request_id, ids, SamplingParams(max_tokens=0), pooling_params=pooling)
                results[request_id] = (ids, [])
        except BaseException:
            self.engine_core.abort_requests(list(results))
            for request_id in results:
                self._states.pop(request_id, None)
            raise
        while self.engine_core.has_unfinished_requests():
            for out in self.engine_core.step():
                self._states.pop(out.request_id, None)
                if out.request_id in results and out.embedding is not None:
                    results[out.request_id] = (results[out.request_id][0], embedding_floats(out.embedding))
        return [(request_id, ids, values) for request_id, (ids, values) in results.items()]

    # --- internals (also used by the offline benchmark) -----------------------------------------

    def _add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_name: str | None = None,
    ) -> None:
        # The one door into the core, as the server's AsyncLLM's: the engine core trusts what it gets.
        request = process_request(
            request_id,
            prompt_token_ids,
            params,
            self._model_facts,
            priority=priority,
            pooling_params=pooling_params,
            lora_name=lora_name,
        )
        self.engine_core.add_request(request)
        self._states[request_id] = self._processor.make_request_state(
            request_id, prompt_token_ids, request.sampling_params, arrival_time=time.time()
        )

    def _run(self, children: dict[str, tuple[RequestOutput, int]]) -> None:
        total = len(children)
        done = 0
        progress = self.progress
        if progress is not None:
            progress(done, total, GENERATING)
        while self.engine_core.has_unfinished_requests():
            for out in self.engine_core.step():
                state = self._states.get(out.request_id)
                if state is None:
                    continue
                delta = self._processor.process(state, out, time.time())
                if delta.finished and out.finish_reason is None:
                    # A stop string ended it here; the core (which knows no text) must stop too.
                    self.engine_core.abort_requests([out.request_id])
                result, index = children[out.request_id]
                _apply_delta(result, result.outputs[index], delta)
                if delta.finished:
                    del self._states[out.request_id]
                    done += 1
                    if progress is not None:
                        progress(done, total, GENERATING)

    def _drain_finished(self) -> None:
        """Forget request states whose outputs were consumed outside generate() (benchmarks)."""
        self._states.clear()

    def _tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise InvalidRequest("a prompt is a string or a dict with 'prompt_token_ids'", param="prompts")

    @staticmethod
    def _broadcast_params(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(num_prompts)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise InvalidRequest(
                f"got {len(params)} sampling params for {num_prompts} prompts", param="sampling_params"
            )
        return params


def _apply_delta(result: RequestOutput, completion: CompletionOutput, delta: Any) -> None:
    completion.text += delta.text
    completion.token_ids.extend(delta.token_ids)
    if delta.logprobs is not None:
        completion.logprobs = (completion.logprobs or []) + delta.logprobs
    if delta.prompt_logprobs is not None:
        result.prompt_logprobs = delta.prompt_logprobs
    result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
    if delta.finished:
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason
        result.finished = all(c.finish_reason is not None for c in result.outputs)


def _in_phase(progress: ProgressFn | None, phase: str) -> ProgressFn | None:
    """`progress` with its third argument (a tensor name, say) replaced by `phase`."""
    if progress is None:
        return None
    report = progress

    def in_phase(done: int, total: int, _detail: str) -> None:
        report(done, total, phase)

    return in_phase
