"""`engine.kv_cache_dtype` in a running engine (a tiny packed GGUF Qwen2 with head_dim 32, float32
activations): float32 KV
is `auto` bit for bit on a float32 model; the lossy formats stay close to it by vLLM's fp8 KV test criterion
(tests/models/quantization/test_fp8.py: greedy with 8 logprobs, `check_logprobs_close`: tokens equal, or at
the first divergence each side's token is in the other's top 8) and a top-1 logprob tolerance; prefix
caching, chunked prefill and preemption give each request the logits it has alone, per format; a bad value
fails at start naming the choices."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from izh import LLM, SamplingParams
from izh.config import CPU_PREFILL_ATTENTION_BUDGETS
from izh.engine.scheduler import PREFILL_TOKEN_PAIRS_BY_PATH
from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.kernels.kv_cache_dtype import KV_CACHE_DTYPES
from tests.engine.test_batch_invariance import PARAMS, PROMPTS, LogitsRecorder, _assert_same

VARIANTS_HERE = cpu_ops.runnable_variants() if cpu_ops.available() else []
_NO_VARIANT = pytest.param(None, marks=pytest.mark.skip(reason="C kernels unavailable here"))
LOSSY = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "q8_0"]
TOP_K = 8  # vLLM's NUM_LOG_PROBS in its fp8 KV cache test (tests/models/quantization/test_fp8.py)
MAX_TOKENS = 4  # and its max_tokens
# The chosen token's logprob may move this much (nats) before the first divergence. vLLM's criterion has no
# number: a token may fall anywhere in the other's top 8, a move of several nats on a real model. 0.5 is
# tighter: measured on SmolLM2-135M Q4_1 (4 prompts x 4 tokens) the formats moved it at most 0.34 (fp8_e5m2;
# bf16 0.19, fp16 0.10, q8_0 0.13, fp8_e4m3 0.26). The tiny random model's attention is far sharper (large
# q/k, chosen so greedy decoding depends on the context): the fp8 formats (3 and 2 mantissa bits) flip its
# tokens at other than near ties, so they are checked on the real model only.
LOGPROB_TOL = 0.5
REAL_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
]


def assert_close_to(base: list[Any], test: list[Any], tol: float, what: str) -> None:
    """vLLM's check_logprobs_close: per prompt the greedy tokens are equal, or at the first divergence each
    side's token is among the other's top TOP_K; before it the chosen logprobs differ by at most `tol`."""
    for b, t in zip(base, test, strict=True):
        b_out, t_out = b.outputs[0], t.outputs[0]
        assert b_out.logprobs is not None and t_out.logprobs is not None
        for pos, (b_lp, t_lp) in enumerate(zip(b_out.logprobs, t_out.logprobs, strict=True)):
            if b_lp.chosen.token_id != t_lp.chosen.token_id:
                assert b_lp.chosen.token_id in {e.token_id for e in t_lp.top}, (
                    f"{what}: not a near tie at {pos}"
                )
                assert t_lp.chosen.token_id in {e.token_id for e in b_lp.top}, (
                    f"{what}: not a near tie at {pos}"
                )
                break
            assert abs(b_lp.chosen.logprob - t_lp.chosen.logprob) <= tol, (what, pos)


@pytest.fixture(scope="module")
def model_path(tiny_gguf_factory: Any) -> str:
    return tiny_gguf_factory("qwen2_d32", "Q4_1")


@pytest.fixture(params=VARIANTS_HERE or [_NO_VARIANT])
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield request.param
    torch.set_num_threads(before)
    cpu_ops.configure()


def _engine(path: str, **kwargs: Any) -> LLM:
    kwargs.setdefault("enable_prefix_caching", False)
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    kwargs.setdefault("max_model_len", 96)
    return LLM(path, **kwargs)


def test_float32_kv_is_auto_bit_for_bit_on_a_float32_model(model_path: str) -> None:
    auto = _engine(model_path)
    assert auto.engine_core.runner.dtype == torch.float32
    assert auto.engine_core.kv_cache_dtype == "float32"
    explicit = _engine(model_path, kv_cache_dtype="float32")
    got = LogitsRecorder(explicit).run(explicit, PROMPTS)
    want = LogitsRecorder(auto).run(auto, PROMPTS)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same(g, w, f"float32 KV, prompt {i}")


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "q8_0"])
def test_lossy_formats_stay_close_to_auto(model_path: str, kv: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = _engine(model_path).generate(prompts, params)
    llm = _engine(model_path, kv_cache_dtype=kv)
    runner = llm.engine_core.runner
    assert runner.kv_caches[0].dtype == runner.kv_format.storage
    assert_close_to(base, llm.generate(prompts, params), LOGPROB_TOL, kv)


def test_lossy_formats_on_a_real_model(smollm2_gguf: str) -> None:
    """SmolLM2-135M (head_dim 64): every lossy format by vLLM's criterion and a 0.5-nat bound."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True)
    kwargs: dict[str, Any] = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 256}
    base = _engine(smollm2_gguf, **kwargs).generate(REAL_PROMPTS, params)
    for kv in LOSSY:
        test = _engine(smollm2_gguf, kv_cache_dtype=kv, **kwargs).generate(REAL_PROMPTS, params)
        assert_close_to(base, test, LOGPROB_TOL, kv)


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "q8_0"])
def test_logits_do_not_depend_on_batch_chunks_preemption_or_prefix_cache(
    variant: str, model_path: str, kv: str
) -> None:
    def engine(**kwargs: Any) -> tuple[LLM, LogitsRecorder]:
        llm = _engine(model_path, cpu_kernels=variant, kv_cache_dtype=kv, **kwargs)
        assert cpu_ops.variant() == variant
        assert llm.engine_core.runner.model.fused_stack is not None  # decodes on the fused C stack
        return llm, LogitsRecorder(llm)

    llm, rec = engine()
    alone = [rec.run(llm, [p])[0] for p in PROMPTS]
    for i, result in enumerate(rec.run(llm, PROMPTS)):
        _assert_same(result, alone[i], f"{kv} batched, prompt {i}")
    chunked, rec_chunked = engine(max_num_batched_tokens=16, max_num_seqs=4)
    for i, result in enumerate(rec_chunked.run(chunked, PROMPTS)):
        _assert_same(result, alone[i], f"{kv} chunked prefill, prompt {i}")
    block_bytes = llm.engine_core.runner.kv_bytes_per_block()
    one_sequence = llm.engine_core.kv_cache_manager.max_blocks_per_request(96, 16)
    small, rec_small = engine(kv_cache_memory_bytes=one_sequence * block_bytes, max_num_batched_tokens=16)
    for i, result in enumerate(rec_small.run(small, PROMPTS)):
        _assert_same(result, alone[i], f"{kv} preempted, prompt {i}")
    assert small.engine_core.make_stats().num_preemptions > 0
    cached, rec_cached = engine(enable_prefix_caching=True)
    no_prompt_rows = msgspec.structs.replace(PARAMS, prompt_logprobs=None)
    rec_cached.run(cached, PROMPTS, no_prompt_rows)
    for i, result in enumerate(rec_cached.run(cached, PROMPTS, no_prompt_rows)):
        _assert_same(result, alone[i], f"{kv} prefix cache hit, prompt {i}")
    assert cached.engine_core.make_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_the_prefill_budget_follows_the_attention_kernel(variant: str, model_path: str, kv: str) -> None:
    """A bfloat16 cache runs attention on the AMX tiles (the amx variant) or vdpbf16ps (avx512), and the
    scheduler's default prefill attention budget and token cost follow; the float32 path elsewhere."""
    llm = _engine(model_path, cpu_kernels=variant, kv_cache_dtype=kv)
    expected = "float32"
    if kv == "bfloat16" and variant == "avx512":
        expected = "dpbf16"
    elif kv == "bfloat16" and variant == "amx":
        expected = cpu_ops.bf16_cache_path(32, 2)  # "tiles" where Linux grants them, else "dpbf16"
        assert expected in ("tiles", "dpbf16")
    assert llm.engine_core.runner.attention_path == expected
    scheduler = llm.engine_core.scheduler
    assert scheduler.prefill_attention_budget == CPU_PREFILL_ATTENTION_BUDGETS[expected]
    assert scheduler.prefill_token_pairs == PREFILL_TOKEN_PAIRS_BY_PATH[expected]
    assert (scheduler.prefill_token_pairs > 0) == (expected != "float32")


@pytest.mark.parametrize(("kv", "row_bytes"), [("float32", 128), ("bfloat16", 64), ("fp8", 32), ("q8_0", 34)])
def test_the_cache_holds_the_arithmetics_tokens(model_path: str, kv: str, row_bytes: int) -> None:
    """Bytes per token follow 2 x layers x KV heads x head_dim x bytes per element (q8_0: 34 per 32), and
    the cache tensors hold exactly that many bytes per block."""
    llm = _engine(model_path, kv_cache_dtype=kv, max_model_len=64)
    runner = llm.engine_core.runner
    mc = runner.model_config
    assert (mc.head_dim, mc.num_hidden_layers, mc.num_key_value_heads) == (32, 3, 1)
    per_token = 2 * 3 * 1 * row_bytes
    assert runner.kv_bytes_per_token() == per_token
    assert runner.kv_tokens_per_gib() == (1 << 30) // per_token
    cache_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert cache_bytes == runner.num_blocks * 16 * per_token


def test_bad_values_fail_at_start_naming_the_choices(model_path: str, tiny_gguf_factory: Any) -> None:
    with pytest.raises(ModelLoadError, match="choose one of") as info:
        _engine(model_path, kv_cache_dtype="int4")
    assert all(name in str(info.value) for name in KV_CACHE_DTYPES)
    with pytest.raises(ModelLoadError, match="multiple of 32"):  # this model's head_dim is 16
        _engine(tiny_gguf_factory("qwen2", "Q4_1"), kv_cache_dtype="q8_0")
