"""FakeEngineCore: a test double of EngineCore that echoes each prompt back, one token per step.

It loads no model (no torch), so the process loop and the frontend can be tested in milliseconds.
Behaviour is chosen per test by a `fake_core.json` in the `config.model` folder (see FakeCoreOptions)
and per request by magic prompt tokens:

- BAD_TOKEN in the prompt: add_request raises an internal IzhError (500), as EngineCore's invariant
  checks do for a request the frontend should not have sent (the request fails alone);
- ASSERT_TOKEN: add_request raises AssertionError (a bug of any kind; the request fails alone);
- CRASH_TOKEN: step() raises once the request runs (the core dies);
- HANG_TOKEN: step() never returns (the core hangs; the heartbeat must notice);
- FOREVER_TOKEN: the echo cycles until max_tokens instead of ending with the prompt;
- GATE_TOKEN: step() holds at the core's StepGate (`FakeEngineCore.gates[config.model]`, thread mode:
  the test and the core share the process) until the test releases it: a long step on demand.

A request ends with "length" after echoing its whole prompt (as if max_tokens were the prompt
length) or at max_tokens, and with "stop" on a stop token id or an EOS id.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from izh.config import EngineConfig
from izh.engine_messages import AddRequest, EngineOutput, SchedulerStats, TokenLogprobs
from izh.errors import IzhError, ModelLoadError

BAD_TOKEN = 999
ASSERT_TOKEN = 994
CRASH_TOKEN = 998
HANG_TOKEN = 997
FOREVER_TOKEN = 996
GATE_TOKEN = 995
OPTIONS_FILE = "fake_core.json"


@dataclass(slots=True)
class FakeCoreOptions:
    """What a test can set in fake_core.json."""

    fail_load: str | None = None
    """Raise ModelLoadError with this message at construction."""
    step_delay_s: float = 0.0
    """Pretend each step computes for this long (paces FOREVER requests)."""
    vocab_size: int = 1000
    max_model_len: int = 256
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepGate:
    """A step with a GATE_TOKEN request sets `entered`, then waits for `release` (set by the test)."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@dataclass(slots=True)
class _FakeRequest:
    request: AddRequest
    num_output_tokens: int = 0
    first_output_sent: bool = False


def write_options(model_dir: Path, **options: object) -> None:
    """Write fake_core.json into model_dir (keys of FakeCoreOptions)."""
    FakeCoreOptions(**options)  # type: ignore[arg-type]  # fail early on a typo
    (model_dir / OPTIONS_FILE).write_text(json.dumps(options))


def make_fake_model(tokenizer_dir: str | Path, model_dir: Path, **options: object) -> Path:
    """A folder FakeEngineCore serves: the tokenizer files (*.json) of `tokenizer_dir` (a tiny
    checkpoint) beside fake_core.json with `options`; returns `model_dir`."""
    for path in Path(tokenizer_dir).glob("*.json"):
        shutil.copy(path, model_dir / path.name)
    write_options(model_dir, **options)
    return model_dir


def _load_options(model: str) -> FakeCoreOptions:
    path = Path(model) / OPTIONS_FILE
    if not path.is_file():
        return FakeCoreOptions()
    return FakeCoreOptions(**json.loads(path.read_text()))


class FakeEngineCore:
    """Echoes prompts; the same attributes and methods as izh.engine.core.EngineCore."""

    gates: ClassVar[dict[str, StepGate]] = {}
    """The latest core's gate per model folder (in this process: thread mode)."""

    def __init__(self, config: EngineConfig) -> None:
        self.options = _load_options(config.model)
        if self.options.fail_load is not None:
            raise ModelLoadError(self.options.fail_load)
        self.max_model_len = config.max_model_len or self.options.max_model_len
        self.num_blocks = 64
        self.block_size = config.block_size
        self.vocab_size = self.options.vocab_size
        self.eos_token_ids = frozenset(self.options.eos_token_ids)
        self.device = "cpu"
        self.dtype = "float32"
        self._running: dict[str, _FakeRequest] = {}
        self._num_steps = 0
        self._num_generation_tokens = 0
        self._num_prompt_tokens = 0
        self._iteration_tokens: list[int] = []
        self._hang = threading.Event()
        self.gate = self.gates[config.model] = StepGate()
        self.shut_down = False

    def add_request(self, req: AddRequest) -> None:
        if req.request_id in self._running:
            raise IzhError(f"internal error: request id {req.request_id!r} is already in use")
        if BAD_TOKEN in req.prompt_token_ids:
            raise IzhError(f"internal error: the prompt contains the forbidden token {BAD_TOKEN}")
        assert ASSERT_TOKEN not in req.prompt_token_ids, "the prompt contains ASSERT_TOKEN"
        self._running[req.request_id] = _FakeRequest(req)
        self._num_prompt_tokens += len(req.prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        outputs = []
        for request_id in request_ids:
            state = self._running.pop(request_id, None)
            if state is not None:
                outputs.append(self._output(state, [], "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def step(self) -> list[EngineOutput]:
        self._num_steps += 1
        if self.options.step_delay_s:
            time.sleep(self.options.step_delay_s)
        if any(GATE_TOKEN in state.request.prompt_token_ids for state in self._running.values()):
            self.gate.entered.set()
            self.gate.release.wait()
        outputs = [self._advance(state) for state in list(self._running.values())]
        self._iteration_tokens.append(len(outputs))
        return outputs

    def _advance(self, state: _FakeRequest) -> EngineOutput:
        prompt = state.request.prompt_token_ids
        if CRASH_TOKEN in prompt:
            raise RuntimeError(f"fake CUDA error in request {state.request.request_id}")
        if HANG_TOKEN in prompt:
            self._hang.wait()
        params = state.request.sampling_params
        token = prompt[state.num_output_tokens % len(prompt)]
        state.num_output_tokens += 1
        self._num_generation_tokens += 1
        finish_reason: str | None = None
        stop_reason: int | None = None
        if token in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            finish_reason = "stop"
        elif state.num_output_tokens >= self._length_limit(state):
            finish_reason = "length"
        if finish_reason is not None:
            del self._running[state.request.request_id]
        output = self._output(state, [token], finish_reason)
        output.stop_reason = stop_reason
        if params.logprobs is not None:
            top = [(token, -0.5), ((token + 1) % self.vocab_size, -1.5)][: params.logprobs]
            output.new_logprobs = [TokenLogprobs(token_id=token, logprob=-0.5, rank=1, top=top)]
        return output

    @staticmethod
    def _length_limit(state: _FakeRequest) -> int:
        """max_tokens, and the prompt's length unless the request echoes forever."""
        prompt = state.request.prompt_token_ids
        limit = state.request.sampling_params.max_tokens or 1 << 62
        return limit if FOREVER_TOKEN in prompt else min(limit, len(prompt))

    def _output(self, state: _FakeRequest, token_ids: list[int], finish_reason: str | None) -> EngineOutput:
        output = EngineOutput(
            request_id=state.request.request_id,
            new_token_ids=token_ids,
            finish_reason=finish_reason,
            num_prompt_tokens=len(state.request.prompt_token_ids),
        )
        if token_ids and not state.first_output_sent:
            state.first_output_sent = True
            output.queued_ts = output.scheduled_ts = time.monotonic()
        return output

    def make_stats(self) -> SchedulerStats:
        iteration_tokens, self._iteration_tokens = self._iteration_tokens, []
        return SchedulerStats(
            num_running=len(self._running),
            num_blocks=self.num_blocks,
            num_steps=self._num_steps,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            iteration_tokens=iteration_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        return True

    def embedding_info(self) -> dict[str, Any]:
        return {}  # Ready's defaults: a decoder that generates

    def lora_info(self) -> dict[str, Any]:
        return {}  # Ready's defaults: LoRA off

    def kv_cache_info(self) -> dict[str, Any]:
        return {}  # Ready's defaults: no KV cache tensors

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        return {"error": "LoRA is off in this server", "status": 400, "code": "invalid_lora_adapter"}

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return {"error": f"the LoRA adapter {name!r} is not loaded", "status": 404, "code": "model_not_found"}

    def kv_block_states(self) -> list[int]:
        """One "block" per running request (so a test can see an abort free it)."""
        return [1] * len(self._running) + [0] * (self.num_blocks - len(self._running))

    def shutdown(self) -> None:
        self.shut_down = True
