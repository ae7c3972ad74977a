"""LoRA deltas inside the fused C decode stack (csrc/lora.c) against the module path's hooks, for mixed
batches (the base model and three adapters of different ranks and targets) and every kernel variant this
CPU runs."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from izh import LLM, SamplingParams
from izh.kernels import cpu as cpu_ops
from tests.fixtures.lora import ALL_TARGETS, build_peft_adapter

VARIANTS = cpu_ops.runnable_variants()
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
NAMES = ["r8-all", None, "r2-qv", "r16-mlp-o", "r8-all", "r2-qv", None, "r16-mlp-o"]
PROMPTS = [{"prompt_token_ids": [5 + 3 * i, 17, 33 * i % 500, 9, 61][: 3 + i % 3]} for i in range(len(NAMES))]

NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.05}
"""How close (log-probability) the two best tokens must be where the stack and the modules part ways: the
deltas' small products are summed in another order than torch's bmm, which can flip a near tie."""


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("lora-stack")
    return {
        "r8-all": build_peft_adapter(tiny_llama_dir, root / "a", r=8, alpha=16, targets=ALL_TARGETS, seed=11),
        "r2-qv": build_peft_adapter(
            tiny_llama_dir, root / "b", r=2, alpha=5, targets=("q_proj", "v_proj"), seed=12
        ),
        "r16-mlp-o": build_peft_adapter(
            tiny_llama_dir,
            root / "c",
            r=16,
            alpha=8,
            targets=("o_proj", "gate_proj", "up_proj", "down_proj"),
            layers=[0],
            seed=13,
        ),
    }


def _assert_same_up_to_near_ties(stack: list, modules: list, tie: float) -> None:
    """Tokens equal; where they part (only at a near tie of the module path), the rest is not compared."""
    for a, b in zip(stack, modules, strict=True):
        ours, theirs = a.outputs[0], b.outputs[0]
        for i, (x, y) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True)):
            if x != y:
                top = sorted(theirs.logprobs[i].top, key=lambda t: -t.logprob)
                assert len(top) >= 2 and top[0].logprob - top[1].logprob < tie, (i, x, y, top)
                break
            assert ours.logprobs[i].chosen.logprob == pytest.approx(
                theirs.logprobs[i].chosen.logprob, abs=tie
            )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_stack_with_lora_equals_the_module_path(
    variant: str, dtype: str, tiny_llama_dir: str, adapters: dict[str, str]
) -> None:
    with cpu_ops.use_variant(variant):
        if dtype == "bfloat16" and not cpu_ops.qgemm_available():
            pytest.skip(f"no bfloat16 record matmuls in the {variant} variant")
        llm = LLM(
            tiny_llama_dir,
            dtype=dtype,
            quantization="int4",
            kv_cache_memory_bytes=8 << 20,
            lora_modules=adapters,
            max_loras=3,
            max_lora_rank=16,
        )
        model = llm.engine_core.runner.model
        fused = model.fused_stack
        assert fused is not None
        lora_calls: list[bool] = []
        run = fused.run
        fused.run = lambda *a, _run=run: lora_calls.append(a[3] is not None) or _run(*a)  # type: ignore[method-assign]
        count = len(NAMES) if dtype == "float32" else min(len(NAMES), 4 * cpu_ops.qgemm_max_rows())
        with_stack = llm.generate(PROMPTS[:count], PARAMS, lora_name=NAMES[:count])
        assert lora_calls == [True] * (PARAMS.max_tokens - 1)  # every decode step, adapters and all
        model.fused_stack = None
        llm.engine_core.reset_prefix_cache()
        modules = llm.generate(PROMPTS[:count], PARAMS, lora_name=NAMES[:count])
        _assert_same_up_to_near_ties(with_stack, modules, NEAR_TIE[dtype])
        # The adapters do change the tokens (the deltas are not lost on the way).
        model.fused_stack = fused
        llm.engine_core.reset_prefix_cache()
        base = llm.generate(PROMPTS[:count], PARAMS)
        changed = [
            a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(base, with_stack, strict=True)
        ]
        assert changed == [name is not None for name in NAMES[:count]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_kernel_equals_its_reference_on_odd_shapes(variant: str, dtype: torch.dtype) -> None:
    """csrc/lora.c alone: inputs and shard widths that are not multiples of the vector width, runs of 1-5
    rows on a slot, the base model between them, a slot of rank 0 and slots out of order."""
    from izh.kernels.cpu.library import STATE, resolve

    slots, max_rank, k = 3, 6, 1030  # rows x rank x (k + out) over the threshold of 2 threads
    bounds = [0, 37, 50, 59]  # three shards
    n, out_features = len(bounds) - 1, bounds[-1]
    ranks = torch.tensor([5, 0, 2], dtype=torch.int32)
    row_slots = torch.tensor([0, 0, 0, 0, 0, -1, 2, 1, 2, 2, 0, -1], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    a = torch.zeros(slots, n * max_rank, k)
    bt = torch.zeros(slots, n * max_rank, out_features)
    for s, r in enumerate(ranks.tolist()):
        a[s, : r * n] = torch.randn(r * n, k, generator=g)
        for j in range(r * n):  # block-diagonal: rank row j * n + i writes shard i only
            i = j % n
            bt[s, j, bounds[i] : bounds[i + 1]] = torch.randn(bounds[i + 1] - bounds[i], generator=g)
    a, bt = a.to(dtype), bt.to(dtype)
    x = torch.randn(len(row_slots), k, generator=g).to(dtype)
    out = torch.randn(len(row_slots), out_features, generator=g).to(dtype)
    expected = out.clone()
    for m, s in enumerate(row_slots.tolist()):
        if s >= 0:
            kr = int(ranks[s]) * n
            t = (x[m : m + 1].float() @ a[s, :kr].float().t()).to(dtype)
            delta = (t.float() @ bt[s, :kr].float()).to(dtype)
            expected[m] = (out[m : m + 1].float() + delta.float()).to(dtype)[0]
    table = torch.tensor([a.data_ptr(), bt.data_ptr(), n, *bounds], dtype=torch.int64)
    with cpu_ops.use_variant(variant):
        lib = (STATE.active or resolve()).handle
        assert lib is not None
        fn = lib.izh_lora_add_f32 if dtype == torch.float32 else lib.izh_lora_add_bf16
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, i64, p, i64, p, i64, p, p, ctypes.c_int]
        fn.restype = ctypes.c_int
        got = out.clone()
        rc = fn(
            x.data_ptr(),
            len(row_slots),
            k,
            got.data_ptr(),
            out_features,
            table.data_ptr(),
            max_rank,
            row_slots.data_ptr(),
            ranks.data_ptr(),
            2,
        )
    assert rc == 0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    base = (row_slots < 0) | (row_slots == 1)
    assert torch.equal(got[base], out[base])  # the base model's rows and the rank-0 slot's: untouched
