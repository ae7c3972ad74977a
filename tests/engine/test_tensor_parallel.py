"""Tensor parallelism in the offline engine, over real gloo ranks on this machine: TP=2 greedy tokens
equal TP=1 in float32 (safetensors and GGUF; tied and untied heads, biases), and a worker rank that dies
is reported as EngineDead naming it, whether it dies during a step or while the engine is idle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from izh.errors import EngineDead
from izh.llm import LLM
from izh.sampling_params import SamplingParams

PROMPTS = ["hello world", "the quick brown fox jumps", "a", "once upon a time there was"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def _llm(path: str, tp: int, **kwargs: object) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20, tensor_parallel_size=tp, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def stopping() -> Iterator[list[LLM]]:
    """LLMs to shut down at the end of a test (their worker ranks exit on rank 0's shutdown plan)."""
    llms: list[LLM] = []
    yield llms
    for llm in llms:
        llm.engine_core.shutdown()


@pytest.mark.parametrize(
    ("kind", "qtype"),
    [("llama", None), ("qwen2", None), ("llama", "Q8_0")],
    ids=["llama-safetensors", "qwen2-bias-untied-sharded", "llama-gguf-q8_0"],
)
def test_tp2_greedy_tokens_equal_tp1_in_float32(
    kind: str,
    qtype: str | None,
    tiny_checkpoint_factory: Callable[[str], str],
    tiny_gguf_factory: Callable[..., str],
    stopping: list[LLM],
) -> None:
    path = tiny_gguf_factory(kind, qtype) if qtype else tiny_checkpoint_factory(kind)
    single = _llm(path, 1)
    expected = _tokens(single)
    parallel = _llm(path, 2)
    stopping.append(parallel)
    runtime = parallel.engine_core.runner.tp_runtime
    assert runtime is not None and runtime.tp.world_size == 2 and len(runtime.procs) == 1
    assert _tokens(parallel) == expected
    # The collectives ran: per step one embedding, 2 per layer, and the logits gather.
    assert runtime.tp.comm_calls > 0


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_worker_fails_the_next_step_naming_it(
    tiny_checkpoint_factory: Callable[[str], str], stopping: list[LLM]
) -> None:
    llm = _llm(tiny_checkpoint_factory("llama"), 2)
    stopping.append(llm)
    assert len(_tokens(llm)) == len(PROMPTS)
    runtime = llm.engine_core.runner.tp_runtime
    assert runtime is not None
    _, proc = runtime.procs[0]
    proc.kill()
    proc.wait()
    with pytest.raises(EngineDead, match=rf"rank 1 \(pid {proc.pid}\) ended \(killed by SIGKILL\)"):
        llm.generate(PROMPTS, GREEDY)


def test_a_worker_that_dies_while_idle_is_noticed_by_the_heartbeat(
    tiny_checkpoint_factory: Callable[[str], str], stopping: list[LLM]
) -> None:
    llm = _llm(tiny_checkpoint_factory("llama"), 2, dist_timeout_s=8.0)  # a heartbeat every 2 s
    stopping.append(llm)
    runtime = llm.engine_core.runner.tp_runtime
    assert runtime is not None
    _, proc = runtime.procs[0]
    proc.kill()
    _wait_for(lambda: runtime.failure is not None, 60)
    assert "rank 1" in (runtime.failure or "")
    with pytest.raises(EngineDead, match="rank 1"):
        llm.generate(PROMPTS, GREEDY)


def test_a_model_that_does_not_split_fails_before_any_rank_starts(
    tiny_checkpoint_factory: Callable[[str], str],
) -> None:
    from izh.errors import ModelLoadError

    # The tiny Llama has 2 KV heads: 4 ranks cannot each take whole ones.
    with pytest.raises(ModelLoadError, match=r"num_key_value_heads 2.*--tensor-parallel-size 1, 2"):
        _llm(tiny_checkpoint_factory("llama"), 4)


def _logprob_values(positions: list | None) -> list[float]:  # type: ignore[type-arg]
    return [p.chosen.logprob for p in positions or [] if p is not None]


def test_chunked_prefill_prefix_cache_logprobs_and_embeddings_match_tp1(
    tiny_checkpoint_factory: Callable[[str], str], stopping: list[LLM]
) -> None:
    """The rest of a step's journey under TP=2: a prompt split over several steps (a 32-token budget), a
    prefix-cache hit, prompt and sampled logprobs (from rank 0's gathered logits), and embeddings pooled
    from the all-reduced hidden states."""
    path = tiny_checkpoint_factory("llama")
    long_prompt = "the history of the city and its river " * 12
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=2)
    results = {}
    for tp in (1, 2):
        llm = _llm(path, tp, max_num_batched_tokens=32)
        if tp == 2:
            stopping.append(llm)
        first = llm.generate([long_prompt], params)[0]
        # Without prompt logprobs (computed at every prompt position, so never cached) the first plain
        # request fills the prefix cache and the second reads it.
        plain = SamplingParams(max_tokens=8, temperature=0)
        again = [llm.generate([long_prompt], plain)[0] for _ in range(2)][1]
        embedding = llm.embed(["an input to embed"])[0].embedding
        results[tp] = (first, again, embedding)
    (first1, _, emb1), (first2, again2, emb2) = results[1], results[2]
    assert len(first1.prompt_token_ids) > 64  # prefilled in at least 3 steps
    assert again2.num_cached_tokens > 0  # the second request hit the prefix cache on every rank
    assert first2.outputs[0].token_ids == first1.outputs[0].token_ids == again2.outputs[0].token_ids
    assert _logprob_values(first2.outputs[0].logprobs) == pytest.approx(
        _logprob_values(first1.outputs[0].logprobs), abs=1e-4
    )
    assert _logprob_values(first2.prompt_logprobs) == pytest.approx(
        _logprob_values(first1.prompt_logprobs), abs=1e-4
    )
    assert emb2 == pytest.approx(emb1, abs=1e-5)
