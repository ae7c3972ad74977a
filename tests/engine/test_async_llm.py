"""AsyncLLM over the FakeEngineCore (echoes prompts): streams, admission, cancellation, deadlines,
drain, engine death; and one request through the real EngineCore when the tiny checkpoint exists."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from izh.config import EngineConfig
from izh.engine_messages import SchedulerStats
from izh.errors import ContextLengthExceeded, EngineDead, InvalidRequest, IzhError, Overloaded
from izh.frontend import async_llm
from izh.frontend.async_llm import REQUEST_SCOPE, AsyncLLM, RequestScope
from izh.frontend.output_processor import RequestOutput
from izh.frontend.stats import RequestMetrics, StatLogger
from izh.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.fake_core import ASSERT_TOKEN, BAD_TOKEN, CRASH_TOKEN, FOREVER_TOKEN, write_options
from tests.fixtures.bpe import train_byte_level_bpe

FAKE = "tests.engine.fake_core:FakeEngineCore"
T = TypeVar("T")
CORPUS = [
    "Hello world, stop here and more text follows.",
    "request number 0 1 2 3 4 5 6 7 8 9 echoes its own words",
    "The quick brown fox jumps over the lazy dog.",
]


def run(coro: Awaitable[T], timeout_s: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    backend = train_byte_level_bpe(CORPUS, 400, ["<|endoftext|>"])
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    backend.save(str(path))
    return path


@pytest.fixture
def make_model(tmp_path: Path, tokenizer_json: Path) -> Callable[..., EngineConfig]:
    """A model folder for the fake core: the tokenizer plus fake_core.json options."""

    def make(**options: Any) -> EngineConfig:
        (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
        write_options(tmp_path, **options)
        return EngineConfig(model=str(tmp_path), served_model_name="fake")

    return make


async def start(config: EngineConfig, **kwargs: Any) -> AsyncLLM:
    kwargs.setdefault("core_mode", "thread")
    return await AsyncLLM.start(config, core_factory=FAKE, **kwargs)


async def collect(stream: Any) -> list[RequestOutput]:
    return [out async for out in stream]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(out.text for out in outputs)


class Recording(StatLogger):
    def __init__(self) -> None:
        self.new_tokens: list[tuple[str, int, bool]] = []
        self.finished: list[RequestMetrics] = []
        self.stats: list[SchedulerStats] = []
        self.enough = asyncio.Event()
        self.enough_after = 1 << 30

    def on_new_tokens(self, request_id: str, num_tokens: int, now: float, is_first: bool) -> None:
        self.new_tokens.append((request_id, num_tokens, is_first))
        if len(self.new_tokens) >= self.enough_after:
            self.enough.set()

    def on_request_finished(self, m: RequestMetrics) -> None:
        self.finished.append(m)

    def on_scheduler_stats(self, s: SchedulerStats) -> None:
        self.stats.append(s)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_concurrent_requests_get_their_own_outputs(
    make_model: Callable[..., EngineConfig], mode: str
) -> None:
    async def body() -> None:
        recording = Recording()
        llm = await start(make_model(), core_mode=mode, stat_loggers=[recording])
        try:
            assert llm.is_ready and llm.model_name == "fake" and llm.ready.vocab_size == 1000
            prompts = {f"r{i}": llm.tokenizer.encode(f"request number {i} echoes", False) for i in range(64)}
            streams = {
                rid: await llm.add_request(rid, ids, SamplingParams(max_tokens=None))
                for rid, ids in prompts.items()
            }
            assert llm.num_in_flight == 64
            results = dict(
                zip(streams, await asyncio.gather(*(collect(s) for s in streams.values())), strict=True)
            )
            for rid, outputs in results.items():
                i = int(rid[1:])
                assert text_of(outputs) == f"request number {i} echoes"
                assert [t for out in outputs for t in out.token_ids] == prompts[rid]
                final = outputs[-1]
                assert final.finished and final.finish_reason == "length"
                assert final.num_output_tokens == final.num_prompt_tokens == len(prompts[rid])
            assert llm.num_in_flight == 0 and llm.num_waiting == 0
            assert sorted(m.request_id for m in recording.finished) == sorted(prompts)
            assert all(m.first_token_time >= m.arrival_time > 0 for m in recording.finished)
            firsts = [rid for rid, _, is_first in recording.new_tokens if is_first]
            assert sorted(firsts) == sorted(prompts)
            stats = llm.get_stats()
            assert stats["num_running"] == 0 and stats["num_requests_in_flight"] == 0
            assert recording.stats
        finally:
            await llm.shutdown()

    run(body())
    assert multiprocessing.active_children() == []


def _limit(prefix: str, rest: str) -> str:
    return f"This model's maximum context length is 16 tokens. However, {prefix}. {rest}"


# (prompt, params, prompt_param) -> (error class, message, param): the bodies the HTTP API returns
# (the API's own checks in serving.py said the same; these pin them at the one validation point).
VALIDATION_ERRORS: list[tuple[list[int], SamplingParams, str, type[InvalidRequest], str, str]] = [
    (
        [1] * 10,
        SamplingParams(max_tokens=7),
        "prompt",
        ContextLengthExceeded,
        _limit(
            "you requested 17 tokens (10 in the prompt, 7 in the completion)",
            "Please reduce the length of the prompt or the completion.",
        ),
        "max_tokens",
    ),
    (
        [1] * 10,
        SamplingParams(max_tokens=7),
        "messages",
        ContextLengthExceeded,
        _limit(
            "you requested 17 tokens (10 in the messages, 7 in the completion)",
            "Please reduce the length of the messages or the completion.",
        ),
        "max_tokens",
    ),
    (
        [1] * 16,
        SamplingParams(max_tokens=None),
        "messages",
        ContextLengthExceeded,
        _limit(
            "your request has 16 input tokens, which leaves no room for the completion",
            "Please reduce the length of the messages.",
        ),
        "messages",
    ),
    (
        [1] * 20,
        SamplingParams(max_tokens=3),
        "prompt.1",
        ContextLengthExceeded,
        _limit(
            "your request has 20 input tokens, which leaves no room for the completion",
            "Please reduce the length of the prompt.1.",
        ),
        "prompt.1",
    ),
    (
        [1] * 17,
        SamplingParams(max_tokens=0),
        "prompt",
        ContextLengthExceeded,
        _limit("your request has 17 input tokens", "Please reduce the length of the prompt."),
        "prompt",
    ),
    (
        [1, 5000],
        SamplingParams(),
        "prompt",
        InvalidRequest,
        "prompt token id 5000 is out of range [0, 1000)",
        "prompt",
    ),
    (
        [-1, 3],
        SamplingParams(),
        "prompt.2",
        InvalidRequest,
        "prompt.2 token id -1 is out of range [0, 1000)",
        "prompt.2",
    ),
    ([], SamplingParams(), "prompt", InvalidRequest, "the prompt is empty", "prompt"),
    (
        [1],
        SamplingParams(stop_token_ids=[5000], max_tokens=2),
        "prompt",
        InvalidRequest,
        "stop_token_ids contains token id 5000, outside [0, 1000)",
        "stop_token_ids",
    ),
    (
        [1] * 10,
        SamplingParams(max_tokens=None, min_tokens=7),
        "prompt",
        InvalidRequest,
        "min_tokens (7) must be <= max_tokens (6)",
        "min_tokens",
    ),
    (
        [1],
        SamplingParams(n=2),
        "prompt",
        InvalidRequest,
        "AsyncLLM takes one sequence per request (n=1), got n=2",
        "n",
    ),
    # The API's order: the prompt's ids, then the context length, then the params' token ids.
    (
        [5000] * 20,
        SamplingParams(max_tokens=7, logit_bias={5000: 1.0}),
        "prompt",
        InvalidRequest,
        "prompt token id 5000 is out of range [0, 1000)",
        "prompt",
    ),
    (
        [1] * 20,
        SamplingParams(max_tokens=7, logit_bias={5000: 1.0}),
        "prompt",
        ContextLengthExceeded,
        _limit(
            "your request has 20 input tokens, which leaves no room for the completion",
            "Please reduce the length of the prompt.",
        ),
        "prompt",
    ),
]


def test_validation_and_context_length(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model(max_model_len=16))
        try:
            for i, (prompt, params, prompt_param, error, message, param) in enumerate(VALIDATION_ERRORS):
                with pytest.raises(error) as info:
                    await llm.add_request(f"bad{i}", prompt, params, prompt_param=prompt_param)
                assert (type(info.value), info.value.message, info.value.param) == (error, message, param)
                assert info.value.status_code == 400
                expected_code = "context_length_exceeded" if error is ContextLengthExceeded else None
                assert info.value.code == expected_code
            with pytest.raises(InvalidRequest) as spec:
                spec_params = StructuredOutputsParams(regex="(a")
                constrained = SamplingParams(max_tokens=2, structured_outputs=spec_params)
                await llm.add_request("spec", [1], constrained)
            assert spec.value.param == "structured_outputs" and "invalid regex" in spec.value.message
            assert llm.num_in_flight == 0  # nothing refused reached the core
            # A prompt-only request may fill the context; max_tokens None takes the rest of it:
            # 12 tokens after a 4-token prompt.
            prompt_only = await llm.add_request("full", [1] * 16, SamplingParams(max_tokens=0))
            prompt_only.abort()
            outputs = await collect(
                await llm.add_request("f", [FOREVER_TOKEN, 1, 2, 3], SamplingParams(max_tokens=None))
            )
            assert outputs[-1].num_output_tokens == 12 and outputs[-1].finish_reason == "length"
            assert llm.num_in_flight == 0
        finally:
            await llm.shutdown()

    run(body())


def test_the_prompt_limit_comes_after_the_validation(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model(max_model_len=16))
        REQUEST_SCOPE.set(RequestScope(max_prompt_tokens=5))
        try:
            # Over both the context and the tenant's limit: the context's error, as the API gives it.
            with pytest.raises(ContextLengthExceeded):
                await llm.add_request("a", [1] * 17, SamplingParams(max_tokens=None))
            with pytest.raises(InvalidRequest) as info:
                await llm.add_request("b", [1] * 6, SamplingParams(max_tokens=2))
            assert info.value.code == "limit_exceeded" and info.value.param == "prompt"
            assert info.value.message == (
                "the prompt has 6 tokens, over the limit of 5 (limits.max_prompt_tokens)"
            )
        finally:
            await llm.shutdown()

    run(body())


def test_overload_is_refused_before_any_output(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model(step_delay_s=0.002), max_requests_in_flight=2, max_waiting_requests=1)
        try:
            forever = SamplingParams(max_tokens=None)
            first = await llm.add_request("a", [FOREVER_TOKEN, 1], forever)
            # "a" has no output yet: the waiting bound (1) refuses the next one.
            with pytest.raises(Overloaded, match="waiting"):
                await llm.add_request("b", [FOREVER_TOKEN, 2], forever)
            await anext(first)
            second = await llm.add_request("b", [FOREVER_TOKEN, 2], forever)
            await anext(second)
            with pytest.raises(Overloaded, match="2 requests in flight") as info:
                await llm.add_request("c", [1], SamplingParams())
            assert info.value.status_code == 503
            assert llm.num_in_flight == 2
            first.abort()
            await llm.abort("b")
            assert llm.num_in_flight == 0
            assert (await collect(await llm.add_request("c", [1, 2], SamplingParams())))[-1].finished
        finally:
            await llm.shutdown()

    run(body())


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_cancelling_the_consumer_aborts_in_the_core(
    make_model: Callable[..., EngineConfig], mode: str
) -> None:
    async def body() -> None:
        recording = Recording()
        llm = await start(make_model(step_delay_s=0.002), core_mode=mode, stat_loggers=[recording])
        try:
            got_output = asyncio.Event()

            async def consume() -> None:
                async for _ in llm.generate(
                    "forever", [FOREVER_TOKEN, 1, 2], SamplingParams(max_tokens=None)
                ):
                    got_output.set()

            task = asyncio.create_task(consume())
            await got_output.wait()
            assert await llm.kv_block_states() != [0] * 64
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert llm.num_in_flight == 0
            # The Abort went out before this call on the same socket: the core freed the request.
            assert await llm.kv_block_states() == [0] * 64
            assert llm.get_stats()["num_running"] == 0
            assert [m.finish_reason for m in recording.finished] == ["abort"]

            stream = await llm.add_request("closed", [FOREVER_TOKEN, 3], SamplingParams(max_tokens=None))
            async with stream:
                await anext(stream)
            assert llm.num_in_flight == 0
            assert await llm.kv_block_states() == [0] * 64
        finally:
            await llm.shutdown()

    run(body())


def test_deadline_ends_with_length(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model(step_delay_s=0.005), request_timeout_s=0.2)
        try:
            prompt = [FOREVER_TOKEN, *llm.tokenizer.encode("Hello world", False)]
            outputs = await collect(await llm.add_request("slow", prompt, SamplingParams(max_tokens=None)))
            final = outputs[-1]
            assert final.finished and final.finish_reason == "length"
            assert "Hello" in text_of(outputs)
            assert final.num_output_tokens < 16 - len(prompt) or final.num_output_tokens > 0
            assert await llm.kv_block_states() == [0] * 64
            # A per-request deadline overrides the default.
            outputs = await collect(
                await llm.add_request("quick", [FOREVER_TOKEN], SamplingParams(max_tokens=None), deadline_s=0)
            )
            assert outputs[-1].finish_reason == "length"
        finally:
            await llm.shutdown()

    run(body())


def test_stop_string_aborts_the_core_request(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model(step_delay_s=0.001))
        try:
            # FOREVER keeps the echo going in the core: only the frontend's Abort ends it there.
            prompt = [FOREVER_TOKEN, *llm.tokenizer.encode("Hello world, stop here and more", False)]
            params = SamplingParams(max_tokens=None, stop=["stop here"])
            outputs = await collect(await llm.add_request("s", prompt, params))
            assert text_of(outputs) == "Hello world, "
            assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", "stop here")
            assert await llm.kv_block_states() == [0] * 64
        finally:
            await llm.shutdown()

    run(body())


def test_core_rejection_fails_one_request(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model())
        try:
            # The frontend validated both; a core that still refuses one has a bug: an internal error
            # (500) for that request alone.
            bad = await llm.add_request("bad", [1, BAD_TOKEN], SamplingParams())
            failed = await llm.add_request("assert", [1, ASSERT_TOKEN], SamplingParams())
            good = await llm.add_request("good", [1, 2, 3], SamplingParams())
            with pytest.raises(IzhError, match="forbidden token") as info:
                await collect(bad)
            assert not isinstance(info.value, InvalidRequest) and info.value.status_code == 500
            with pytest.raises(IzhError, match="ASSERT_TOKEN") as info:
                await collect(failed)
            assert not isinstance(info.value, InvalidRequest)
            assert (await collect(good))[-1].finish_reason == "length"
            assert not llm.is_dead
        finally:
            await llm.shutdown()

    run(body())


def test_slow_consumer_is_aborted_with_an_error(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        recording = Recording()
        recording.enough_after = 4  # the 4th unread output breaks the bound of 3
        llm = await start(make_model(), max_buffered_outputs=3, stat_loggers=[recording])
        try:
            stream = await llm.add_request("slow", [FOREVER_TOKEN, 1], SamplingParams(max_tokens=None))
            await recording.enough.wait()  # the core produced more than the bound; nobody read
            with pytest.raises(IzhError, match="read too slowly"):
                await collect(stream)
            assert llm.num_in_flight == 0
            assert await llm.kv_block_states() == [0] * 64
        finally:
            await llm.shutdown()

    run(body())


def test_unread_outputs_are_merged(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        recording = Recording()
        llm = await start(make_model(), stat_loggers=[recording])
        try:
            prompt = llm.tokenizer.encode("The quick brown fox jumps", False)
            recording.enough_after = len(prompt)
            stream = await llm.add_request("m", prompt, SamplingParams())
            await recording.enough.wait()  # every step's output arrived before the first read
            outputs = await collect(stream)
            assert len(outputs) == 1
            assert outputs[0].token_ids == prompt and outputs[0].text == "The quick brown fox jumps"
        finally:
            await llm.shutdown()

    run(body())


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_engine_death_fails_in_flight_requests(make_model: Callable[..., EngineConfig], mode: str) -> None:
    async def body() -> None:
        llm = await start(make_model(step_delay_s=0.002), core_mode=mode)
        try:
            bystander = await llm.add_request("b", [FOREVER_TOKEN, 1], SamplingParams(max_tokens=None))
            await anext(bystander)
            crash = await llm.add_request("c", [1, CRASH_TOKEN], SamplingParams())
            with pytest.raises(EngineDead, match="fake CUDA error"):
                await collect(crash)
            with pytest.raises(EngineDead):
                await collect(bystander)
            assert llm.is_dead and not llm.is_ready and "fake CUDA error" in (llm.dead_reason or "")
            assert llm.num_in_flight == 0
            with pytest.raises(EngineDead):
                await llm.add_request("late", [1], SamplingParams())
        finally:
            await llm.shutdown()

    run(body())
    assert multiprocessing.active_children() == []


def test_drain_on_shutdown_lets_in_flight_requests_finish(make_model: Callable[..., EngineConfig]) -> None:
    async def body() -> None:
        llm = await start(make_model(step_delay_s=0.01), core_mode="process")
        prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.", False)
        stream = await llm.add_request("drained", prompt, SamplingParams(max_tokens=None))
        forever = await llm.add_request("forever", [FOREVER_TOKEN, 1], SamplingParams(max_tokens=None))
        await anext(forever)
        consumer = asyncio.create_task(collect(stream))
        forever_consumer = asyncio.create_task(collect(forever))
        shutdown = asyncio.create_task(llm.shutdown(drain_timeout_s=1.0))
        await asyncio.sleep(0)  # let shutdown begin draining
        assert not llm.is_ready
        with pytest.raises(Overloaded, match="shutting down"):
            await llm.add_request("late", [1], SamplingParams())
        outputs = await consumer
        assert text_of(outputs) == "The quick brown fox jumps over the lazy dog."
        assert outputs[-1].finish_reason == "length"
        await shutdown
        with pytest.raises(EngineDead, match="shut down"):
            await forever_consumer

    run(body())
    assert multiprocessing.active_children() == []


def test_failed_start_raises_a_clear_error(make_model: Callable[..., EngineConfig], tmp_path: Path) -> None:
    async def body() -> None:
        from izh.errors import ModelLoadError

        with pytest.raises(ModelLoadError, match="weights are corrupt"):
            await start(make_model(fail_load="weights are corrupt"), core_mode="process")
        (tmp_path / "tokenizer.json").write_text("not json")
        write_options(tmp_path)
        with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
            await start(EngineConfig(model=str(tmp_path)), core_mode="process")

    run(body())
    assert multiprocessing.active_children() == []


def test_real_engine_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request through the real EngineCore on the tiny random Llama checkpoint; requests that
    skipped the frontend's validation fail alone there with an internal error."""
    try:
        import izh.engine.core  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"izh.engine.core is not importable: {exc}")
    try:
        model_dir = request.getfixturevalue("tiny_llama_dir")
    except pytest.FixtureLookupError:
        pytest.skip("the tiny_llama_dir fixture is not available")

    async def body() -> None:
        config = EngineConfig(
            model=str(model_dir), device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 22
        )
        llm = await AsyncLLM.start(config, core_mode="process")
        try:
            prompt = llm.tokenizer.encode("Hello", False) or [1]
            outputs = await collect(
                await llm.add_request(
                    "real", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
                )
            )
            final = outputs[-1]
            assert final.finished and final.finish_reason == "length"
            assert final.num_output_tokens == 5 and len([t for o in outputs for t in o.token_ids]) == 5
            assert "".join(o.text for o in outputs) == llm.tokenizer.decode(
                [t for o in outputs for t in o.token_ids], skip_special_tokens=True
            )
            assert llm.get_stats()["num_running"] == 0
            # Without the one validation point, a bad request reaches the core: a bug, which fails
            # that request alone (500, not a user's 400) before it can index the embedding table.
            with monkeypatch.context() as patch:
                patch.setattr(async_llm, "validate_request", lambda prompt, params, **kwargs: params)
                greedy = SamplingParams(temperature=0.0, max_tokens=5)
                bad_ids = await llm.add_request("bad-ids", [1, 10**6], greedy)
                too_long = await llm.add_request("too-long", [1] * 64, greedy)
                past_vocab = SamplingParams(temperature=0.0, max_tokens=5, allowed_token_ids=[10**6])
                bad_params = await llm.add_request("bad-params", prompt, past_vocab)
            for stream in (bad_ids, too_long, bad_params):
                with pytest.raises(IzhError, match="internal error") as info:
                    await collect(stream)
                assert not isinstance(info.value, InvalidRequest)
            after = await collect(await llm.add_request("after", prompt, greedy))
            assert after[-1].finish_reason == "length" and not llm.is_dead
        finally:
            await llm.shutdown()

    run(body(), timeout_s=240.0)
    assert multiprocessing.active_children() == []
