"""Gemma 2 and Gemma 3 through the offline engine against transformers, on tiny random checkpoints
whose sliding window (8 keys) is much shorter than the prompts: prefill, decode, chunked prefill and
prefix-cache hits all cross the window; from the HF folder and from its GGUF conversion."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from izh import LLM, SamplingParams
from izh.errors import UnsupportedModel
from izh.model import AttentionMetadata, load_model
from izh.model.parallel import check_tensor_parallel

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    "hello world",  # shorter than the window: the engine's own attention paths
    "the quick brown fox jumps over the lazy dog and then the dog sleeps",
    "Once upon a time, in a land far away, there lived a model with a cache",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
]
KINDS = ["gemma2", "gemma3"]


def _llm(path: str, **kwargs: object) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(path, dtype="float32", **kwargs)  # type: ignore[arg-type]


def _hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def hf_dir(kind: str, tiny_checkpoint_factory: Callable[[str], str]) -> str:
    return tiny_checkpoint_factory(kind)


@pytest.fixture(scope="module")
def reference(hf_dir: str, tiny_tokenizer) -> list[list[int]]:
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    assert max(map(len, prompts)) > 8 > min(map(len, prompts))
    return _hf_greedy(hf_dir, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_equals_transformers_batched_and_alone(
    source: str, kind: str, hf_dir: str, tiny_gguf_factory: Callable[..., str], reference: list[list[int]]
) -> None:
    path = hf_dir if source == "hf" else tiny_gguf_factory(kind, "F32")
    llm = _llm(path)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == reference
    llm.engine_core.check_invariants()


def test_chunked_prefill_and_prefix_cache_equal_transformers(hf_dir: str, tiny_tokenizer) -> None:
    # Chunks of 5 tokens (< the window) over 60-token prompts sharing 4 blocks of prefix.
    long_prompts = [" ".join(PROMPTS[1:]) + " " + tail for tail in ("and more", "or less")]
    ids = [tiny_tokenizer.encode(p).ids for p in long_prompts]
    assert min(map(len, ids)) > 40
    expected = _hf_greedy(hf_dir, ids, GREEDY.max_tokens)
    chunked = _llm(hf_dir, max_num_batched_tokens=5, max_num_seqs=2, enable_prefix_caching=False)
    assert _tokens(chunked.generate(long_prompts, GREEDY)) == expected
    cached = _llm(hf_dir, block_size=16)
    first = cached.generate([long_prompts[0]], GREEDY)[0]
    second = cached.generate([long_prompts[1]], GREEDY)[0]
    assert second.num_cached_tokens >= 32
    assert _tokens([first, second]) == expected
    cached.engine_core.check_invariants()


def test_gemma_config_from_hf_and_gguf(kind: str, hf_dir: str, tiny_gguf_factory: Callable[..., str]) -> None:
    from izh.model.loader import load_model_config

    hf = load_model_config(hf_dir)
    gguf = load_model_config(tiny_gguf_factory(kind, "F32"))
    for config in (hf, gguf):
        assert config.architecture == kind
        assert config.sliding_window == 8
        assert config.query_pre_attn_scalar == 16
        assert config.hidden_act == "gelu_pytorch_tanh"
    assert hf.sliding_layers == gguf.sliding_layers
    with pytest.raises(UnsupportedModel, match="tensor-parallel-size 1"):
        check_tensor_parallel(hf, 2)
    if kind == "gemma3":
        assert hf.sliding_layers == (True,) * 5 + (False,)
        assert (hf.rope_local_theta, hf.qk_norm, hf.attn_logit_softcapping) == (10000.0, True, 0.0)
    else:
        assert hf.sliding_layers == (True, False)
        assert (hf.attn_logit_softcapping, hf.final_logit_softcapping) == (5.0, 3.0)
        assert (gguf.attn_logit_softcapping, gguf.final_logit_softcapping) == (5.0, 3.0)


def test_prefill_logits_match_transformers(kind: str, hf_dir: str, tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    ours, _ = load_model(hf_dir, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = ours.compute_logits(
            ours(flat, positions, AttentionMetadata.for_prefill(list(map(len, prompts))))
        )
        start = 0
        for ids in prompts:
            ref = hf(torch.tensor([ids])).logits[0]
            # GeGLU runs izh's kernel (a few ulps from torch's tanh formula): logits of about 5 agree to 3e-4
            assert (logits[start : start + len(ids)] - ref).abs().max().item() < 3e-4
            assert torch.equal(logits[start : start + len(ids)].argmax(-1), ref.argmax(-1))
            start += len(ids)


@pytest.mark.parametrize(
    ("qtype", "kv_cache_dtype"), [("Q4_1", "auto"), ("Q5_0", "auto"), ("Q4_1", "bfloat16"), ("Q5_0", "fp8")]
)
def test_decode_steps_run_gemmas_c_stack_with_the_module_paths_logprobs(
    kind: str, qtype: str, kv_cache_dtype: str, tiny_gguf_factory: Callable[..., str]
) -> None:
    """A packed float32 Gemma (izh's records from Q4_1, the file's own blocks from Q5_0) decodes through its
    fused C stack (izh.model.gemma_stack: windows, KV groups, soft-cap, q/k norms), with its KV cache in
    float32, bfloat16 or fp8, and its tokens and logprobs are exactly the module path's. (The tiny
    checkpoints' head_dim of 16 holds no q8_0 block.)"""
    from izh.kernels import cpu as cpu_ops

    if not cpu_ops.records_f32_available():
        pytest.skip("izh's C kernels are not built here")
    llm = _llm(tiny_gguf_factory(kind, qtype), max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    model = llm.engine_core.runner.model
    stack = model.gemma_stack
    assert stack is not None and model.fused_stack is None
    assert llm.engine_core.runner.max_decode_rows == stack.max_tokens
    calls: list[int] = []
    run = stack.run
    stack.run = lambda *a, _run=run: calls.append(1) or _run(*a)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    with_stack = llm.generate(PROMPTS, params)
    assert len(calls) == 11  # every decode step after the prefill, past the 8-key window
    model.gemma_stack = None
    llm.engine_core.reset_prefix_cache()
    without = llm.generate(PROMPTS, params)
    for a, b in zip(with_stack, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
