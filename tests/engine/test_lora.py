"""LoRA in the offline engine against transformers + peft, mixed batches, slots, the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from izh import LLM, SamplingParams
from izh.errors import LoraAdapterError, ModelNotFound
from izh.kernels import cpu as cpu_ops
from tests.fixtures.lora import ALL_TARGETS, build_peft_adapter, peft_greedy, peft_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 33, 9, 61, 2, 88, 140], [300, 12, 7, 45], [11, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121]]
PROMPT_DICTS = [{"prompt_token_ids": p} for p in PROMPTS]


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "all-r8": build_peft_adapter(tiny_llama_dir, root / "all-r8", r=8, alpha=16, seed=1),
        "attn-r2": build_peft_adapter(
            tiny_llama_dir, root / "attn-r2", r=2, alpha=7, targets=("q_proj", "v_proj"), seed=2
        ),
        "mlp-r16-rslora": build_peft_adapter(
            tiny_llama_dir,
            root / "mlp-r16-rslora",
            r=16,
            alpha=4,
            targets=("gate_proj", "up_proj", "down_proj"),
            use_rslora=True,
            seed=3,
        ),
        "o-k-layer1": build_peft_adapter(
            tiny_llama_dir,
            root / "o-k-layer1",
            r=4,
            alpha=32,
            targets=("o_proj", "k_proj"),
            layers=[1],
            seed=4,
        ),
    }


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir: str, adapters: dict[str, str]) -> LLM:
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20, lora_modules=adapters, max_loras=4)


@pytest.mark.parametrize("name", ["all-r8", "attn-r2", "mlp-r16-rslora", "o-k-layer1"])
def test_greedy_equals_transformers_with_peft(
    name: str, lora_llm: LLM, tiny_llama_dir: str, adapters: dict[str, str]
) -> None:
    out = lora_llm.generate(PROMPT_DICTS[:2], GREEDY, lora_name=name)
    base = peft_greedy(tiny_llama_dir, None, PROMPTS[0], 12)
    for prompt, tokens in zip(PROMPTS[:2], _tokens(out), strict=True):
        assert tokens == peft_greedy(tiny_llama_dir, adapters[name], prompt, 12), name
    assert _tokens(out)[0] != base  # the adapter changes the answer: a test that can fail


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_greedy_equals_peft_on_qkv_bias_and_qk_norm_models(
    kind: str, tiny_checkpoint_factory, tmp_path: Path
) -> None:
    base = tiny_checkpoint_factory(kind)
    adapter = build_peft_adapter(base, tmp_path / "a", r=4, alpha=8, seed=5)
    llm = LLM(base, kv_cache_memory_bytes=8 << 20, lora_modules={"a": adapter})
    out = llm.generate(PROMPT_DICTS[0], GREEDY, lora_name="a")
    assert _tokens(out)[0] == peft_greedy(base, adapter, PROMPTS[0], 12)


def test_mixed_batch_equals_each_request_alone(lora_llm: LLM) -> None:
    names = [None, "all-r8", "attn-r2", None, "all-r8", "mlp-r16-rslora"]
    prompts = [PROMPT_DICTS[i % 3] for i in range(len(names))]
    together = _tokens(lora_llm.generate(prompts, GREEDY, lora_name=names))
    for prompt, name, tokens in zip(prompts, names, together, strict=True):
        lora_llm.engine_core.reset_prefix_cache()
        assert _tokens(lora_llm.generate(prompt, GREEDY, lora_name=name))[0] == tokens, name
    assert len({tuple(t) for t in together[:3]}) == 3 or PROMPTS[0] != PROMPTS[1]


def test_prefix_cache_is_keyed_on_the_adapter(lora_llm: LLM) -> None:
    core = lora_llm.engine_core
    core.reset_prefix_cache()
    prompt = {"prompt_token_ids": list(range(40, 80))}  # 40 tokens: 2 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def cached(name: str | None) -> int:
        before = core.kv_cache_manager.prefix_cache_hits
        lora_llm.generate(prompt, params, lora_name=name)
        return core.kv_cache_manager.prefix_cache_hits - before

    assert cached("all-r8") == 0
    assert cached("all-r8") == 32  # the same adapter reuses its blocks
    assert cached("attn-r2") == 0  # another adapter does not
    assert cached(None) == 0  # nor does the base model
    assert cached(None) == 32


def test_lru_eviction_with_one_slot_keeps_tokens_right(tiny_llama_dir: str, adapters: dict[str, str]) -> None:
    llm = LLM(
        tiny_llama_dir,
        kv_cache_memory_bytes=8 << 20,
        lora_modules={"a": adapters["all-r8"], "b": adapters["attn-r2"]},
        max_loras=1,
        enable_prefix_caching=False,
    )
    expected = {
        name: _tokens(
            LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20, lora_modules={name: path}).generate(
                PROMPT_DICTS, GREEDY, lora_name=name
            )
        )
        for name, path in (("a", adapters["all-r8"]), ("b", adapters["attn-r2"]))
    }
    manager = llm.engine_core.runner.lora
    assert manager is not None
    for name in ("a", "b", "a", "b"):
        assert _tokens(llm.generate(PROMPT_DICTS, GREEDY, lora_name=name)) == expected[name]
    assert manager.num_slot_loads == 4  # one slot: every switch evicts the other adapter
    # Both adapters in one call: the scheduler runs one adapter at a time (the other waits for the slot).
    names = ["a", "b", None, "b", "a", None]
    prompts = [PROMPT_DICTS[i % 3] for i in range(len(names))]
    out = _tokens(llm.generate(prompts, GREEDY, lora_name=names))
    for i, name in enumerate(names):
        if name is not None:
            assert out[i] == expected[name][i % 3]


def test_adapter_errors_say_what_is_wrong(lora_llm: LLM, adapters: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        lora_llm.generate(PROMPT_DICTS[0], GREEDY, lora_name="nope")
    with pytest.raises(LoraAdapterError, match="already loaded"):
        lora_llm.load_lora_adapter("all-r8", adapters["all-r8"])
    with pytest.raises(LoraAdapterError, match="not a folder"):
        lora_llm.load_lora_adapter("x", str(tmp_path / "missing"))
    with pytest.raises(LoraAdapterError, match=r"no adapter_config\.json"):
        lora_llm.load_lora_adapter("x", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 8}))
    with pytest.raises(LoraAdapterError, match="above max_lora_rank 16"):
        lora_llm.load_lora_adapter("x", str(tmp_path))
    config = json.loads((Path(adapters["all-r8"]) / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["embed_tokens"]}))
    with pytest.raises(LoraAdapterError, match="target_modules"):
        lora_llm.load_lora_adapter("x", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraAdapterError, match=r"no adapter_model\.safetensors"):
        lora_llm.load_lora_adapter("x", str(tmp_path))


def test_adapter_for_another_model_is_refused(lora_llm: LLM, tiny_qwen3_dir: str, tmp_path: Path) -> None:
    other = build_peft_adapter(tiny_qwen3_dir, tmp_path / "q3", r=4, alpha=8)
    with pytest.raises(LoraAdapterError, match="another model"):
        lora_llm.load_lora_adapter("q3", other)


def test_unload_while_running_finishes_the_request_then_frees_the_weights(
    lora_llm: LLM, adapters: dict[str, str]
) -> None:
    lora_llm.load_lora_adapter("tmp", adapters["attn-r2"])
    expected = _tokens(lora_llm.generate(PROMPT_DICTS[0], GREEDY, lora_name="tmp"))[0]
    core = lora_llm.engine_core
    lora_llm._add_request("unload-me", PROMPTS[0], GREEDY, lora_name="tmp")
    tokens = [t for out in core.step() for t in out.new_token_ids]
    assert core.unload_lora_adapter("tmp") == {}
    assert core.unload_lora_adapter("tmp")["status"] == 404
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    lora_llm._states.clear()
    assert tokens == expected
    manager = core.runner.lora
    assert manager is not None and "tmp" not in [a.name for a in manager.loaded()]
    with pytest.raises(ModelNotFound):
        lora_llm.generate(PROMPT_DICTS[0], GREEDY, lora_name="tmp")


needs_records = pytest.mark.skipif(not cpu_ops.records_f32_available(), reason="izh's C record kernels")


@needs_records
def test_packed_float32_records_take_the_deltas_on_the_fused_stack(
    tiny_llama_dir: str, adapters: dict[str, str]
) -> None:
    packed = LLM(
        tiny_llama_dir,
        kv_cache_memory_bytes=8 << 20,
        dtype="float32",
        quantization="int8",
        lora_modules={"a": adapters["all-r8"]},
    )
    model = packed.engine_core.runner.model
    fused = model.fused_stack
    assert fused is not None
    calls: list[bool] = []
    run = fused.run
    fused.run = lambda *a, _run=run: calls.append(a[3] is not None) or _run(*a)  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    base = packed.generate(PROMPT_DICTS[0], params)[0].outputs[0]
    assert calls == [False] * 5  # base-only decode steps: the fused C stack, no LoRA
    calls.clear()
    names = ["a", None, "a"]
    mixed = packed.generate(PROMPT_DICTS, params, lora_name=names)
    assert calls == [True] * 5  # decode steps with adapter tokens: the stack, deltas and all
    for prompt, name, out in zip(PROMPT_DICTS, names, mixed, strict=True):
        packed.engine_core.reset_prefix_cache()
        alone = packed.generate(prompt, params, lora_name=name)[0].outputs[0]
        assert alone.token_ids == out.outputs[0].token_ids
    dense = LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20, lora_modules={"a": adapters["all-r8"]})
    dense_out = dense.generate(PROMPT_DICTS[0], params, lora_name="a")[0].outputs[0]
    with_adapter = mixed[0].outputs[0]
    assert with_adapter.token_ids != base.token_ids
    # int8 weights against float32: the adapter's first token, with a close log-probability.
    assert with_adapter.token_ids[0] == dense_out.token_ids[0]
    assert with_adapter.logprobs[0].chosen.logprob == pytest.approx(
        dense_out.logprobs[0].chosen.logprob, abs=0.1
    )


@pytest.mark.slow
def test_smollm2_with_a_random_peft_adapter_equals_transformers(smollm2_gguf: str, tmp_path: Path) -> None:
    from tests.fixtures.smollm2 import SMOLLM2_CHAT_IDS

    adapter = build_peft_adapter(smollm2_gguf, tmp_path / "smol", r=8, alpha=16, targets=ALL_TARGETS)
    llm = LLM(
        smollm2_gguf,
        dtype="float32",
        quantization="none",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        lora_modules={"smol": adapter},
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": SMOLLM2_CHAT_IDS}] * 2
    ours = _tokens(llm.generate(prompts, params, lora_name=["smol", None]))
    expected = peft_greedy(smollm2_gguf, adapter, SMOLLM2_CHAT_IDS, 16)
    assert ours[0] == expected
    assert ours[0] != ours[1]


# How far the packed path's choice may sit below the reference's best, in nats. The int4 records hold the
# file's weights exactly, but the activations go into every matmul as int8 per 32 inputs and the LM head
# runs as int8 records: on SmolLM2 that puts a token's logprob up to ~0.1 nats from float32 transformers,
# and a tiny float difference between kernel builds (FMA contraction in attention) can flip an int8
# rounding, so builds part at different near-ties (measured: the same prefix's top logprobs 0.01-0.03
# nats apart between the generic, avx2 and avx512 builds; the avx2 build's first divergence on these
# prompts sits 0.094 below the reference's best). A wrong or missing adapter moves them by far more: the
# test's control checks that the base model alone fails this bound.
PACKED_LORA_NATS = 0.15


def _first_gap(ours: list[int], ref: torch.Tensor) -> float:
    """The reference's best logprob minus that of our token at our first different token (0 if none)."""
    for step, token in enumerate(ours):
        best = int(ref[step].argmax())
        if token != best:
            return float(ref[step, best] - ref[step, token])
    return 0.0


@pytest.mark.slow
def test_smollm2_default_packed_with_an_adapter_equals_peft_but_for_near_ties(
    smollm2_gguf: str, tmp_path: Path
) -> None:
    """The default settings (int4 records, float32 activations, int8 inside the matmuls) with an adapter:
    greedy tokens equal transformers + peft on the dequantized GGUF, a divergence accepted only where the
    reference's top two log-probabilities are within PACKED_LORA_NATS (after it the texts may part); the
    same engine without the adapter does not pass that check."""
    adapter = build_peft_adapter(smollm2_gguf, tmp_path / "smol", r=8, alpha=16, targets=ALL_TARGETS)
    llm = LLM(smollm2_gguf, kv_cache_memory_bytes=64 << 20, max_model_len=512, lora_modules={"smol": adapter})
    assert llm.engine_core.runner.quantization == "int4"
    tokenizer = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    with_adapter = llm.generate(batch, params, lora_name="smol")
    without = llm.generate(batch, params)
    control_gaps = []
    for prompt, out, base in zip(prompts, with_adapter, without, strict=True):
        ours = out.outputs[0].token_ids
        ref = peft_logprobs(smollm2_gguf, adapter, prompt + ours)[len(prompt) - 1 : -1]
        gap = _first_gap(ours, ref)
        assert gap < PACKED_LORA_NATS, f"{tokenizer.decode(prompt)!r}: differs from peft, gap {gap:.3f} nats"
        base_ids = base.outputs[0].token_ids
        base_ref = peft_logprobs(smollm2_gguf, adapter, prompt + base_ids)[len(prompt) - 1 : -1]
        control_gaps.append(_first_gap(base_ids, base_ref))
    assert max(control_gaps) > PACKED_LORA_NATS, control_gaps  # the check tells an adapter from none
