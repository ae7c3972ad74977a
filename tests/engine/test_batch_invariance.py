"""Batch invariance on every CPU kernel variant this machine runs: a packed model's logits (GGUF Q4_1 in
izh's records, or Q5_0 in the file's own blocks) for a request (Llama, Qwen2, and Gemma 2 and 3 and Phi-3,
whose sliding windows free KV blocks) are bit-identical whether it runs alone, in a batch of prompts of mixed
lengths, with its prompt prefilled in small chunks, after preemption, or from the prefix cache
(docs/operations.md, "Batch invariance"). The logits are read at the runner (every sampled row and every
prompt row, float32), not through the sampled tokens alone. Decode-only steps of these packed float32 models
run the fused C decode stacks (Gemma's its own), the others the modules: both must agree to the bit."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch

from izh import LLM, SamplingParams
from izh.kernels import cpu as cpu_ops
from izh.model.packed import GGUFBlocks

VARIANTS_HERE = cpu_ops.runnable_variants() if cpu_ops.available() else []
_NO_VARIANT = pytest.param(None, marks=pytest.mark.skip(reason="C kernels unavailable here"))

# Token-id prompts of mixed lengths (the tiny model's vocabulary is small); two share a 40-token prefix.
_SHARED = [(7 * i + 3) % 251 + 5 for i in range(40)]
PROMPTS = [
    [(11 * i + 1) % 241 + 3 for i in range(57)],
    [5, 17, 33],
    [*_SHARED, 9, 8, 7],
    [(13 * i + 2) % 233 + 4 for i in range(23)],
    [*_SHARED, 21, 22, 23, 24, 25, 26],
    [42],
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)


class LogitsRecorder:
    """Keeps, per request id and position, the float32 logits of every prompt row and every sampled row
    as the runner hands them to the prompt logprobs and to the sampler. A row computed twice (a preempted
    request recomputes its prompt) must come out the same both times."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine_core.runner
        self.rows: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
        self.recomputed = 0
        sample, prompt_logprobs = runner._sample, runner._prompt_logprobs

        def keep(request_id: str, key: tuple[str, int], row: torch.Tensor) -> None:
            rows = self.rows[request_id]
            if key in rows:
                self.recomputed += 1
                assert torch.equal(rows[key], row), f"request {request_id}: {key} recomputed differently"
            else:
                rows[key] = row.clone()

        def record_sample(scheduled: Any, sample_rows: Any, logits: torch.Tensor, *rest: Any) -> None:
            offset = 0
            for i, _, num_rows in sample_rows:  # (batch index, first row, rows): 1 row without drafts
                assert num_rows == 1, "these engines run no speculative drafts"
                s = scheduled[i]
                keep(
                    s.request.request_id,
                    ("sampled", s.num_computed_tokens_before + s.num_scheduled_tokens),
                    logits[offset],
                )
                offset += num_rows
            sample(scheduled, sample_rows, logits, *rest)

        def record_prompt(scheduled: Any, prompt_rows: Any, logits: torch.Tensor, out: Any) -> None:
            offset = 0
            for i, rows, _ in prompt_rows:
                s = scheduled[i]
                for r in range(len(rows)):
                    keep(
                        s.request.request_id, ("prompt", s.num_computed_tokens_before + r), logits[offset + r]
                    )
                offset += len(rows)
            prompt_logprobs(scheduled, prompt_rows, logits, out)

        runner._sample = record_sample  # type: ignore[method-assign]
        runner._prompt_logprobs = record_prompt  # type: ignore[method-assign]

    def run(self, llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[Result]:
        """Generate `prompts` together; per prompt its rows' logits by (kind, position) and its tokens."""
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results = []
        for out in outputs:
            rows = self.rows.pop(out.request_id)
            prompt_rows = len(out.prompt_token_ids) - 1 if params.prompt_logprobs is not None else 0
            assert len(rows) == prompt_rows + params.max_tokens
            results.append(Result(rows, out.outputs[0].token_ids))
        return results


@dataclass(frozen=True)
class Result:
    rows: dict[tuple[str, int], torch.Tensor]
    tokens: list[int]


def _assert_same(got: Result, want: Result, what: str) -> None:
    """got's rows (all or, without prompt logprobs, the sampled ones) have want's bits."""
    assert got.tokens == want.tokens, f"{what}: other tokens"
    assert set(got.rows) <= set(want.rows) and any(kind == "sampled" for kind, _ in got.rows)
    for key, row in got.rows.items():
        assert torch.equal(row, want.rows[key]), f"{what}: other logits at {key}"


@pytest.fixture(params=VARIANTS_HERE or [_NO_VARIANT])
def variant(request: pytest.FixtureRequest) -> Iterator[str]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the OpenMP paths of the kernels too
    yield request.param
    torch.set_num_threads(before)
    cpu_ops.configure()  # back to the environment's variant for the tests after


@pytest.mark.parametrize(
    ("kind", "qtype"),
    # Q4_1: izh's records; Q5_0: the file's own blocks (their matmuls on the AMX tiles from 12 rows in the
    # amx variant: prefills there, decodes on AVX-512)
    [
        ("llama", "Q4_1"),
        ("qwen2", "Q4_1"),
        ("qwen2", "Q5_0"),
        ("gemma2", "Q4_1"),
        ("gemma3", "Q4_1"),
        ("gemma3", "Q5_0"),
        ("phi3", "Q4_1"),
    ],
)
def test_logits_do_not_depend_on_batch_chunks_preemption_or_prefix_cache(
    variant: str, kind: str, qtype: str, tiny_gguf_factory
) -> None:
    path = tiny_gguf_factory(kind, qtype)

    def engine(**kwargs: Any) -> tuple[LLM, LogitsRecorder]:
        kwargs.setdefault("enable_prefix_caching", False)
        kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
        kwargs.setdefault("max_model_len", 96)
        llm = LLM(path, cpu_kernels=variant, **kwargs)
        runner = llm.engine_core.runner
        assert runner.dtype == torch.float32
        packed = runner.model.model.layers[0].self_attn.qkv_proj.packed
        assert isinstance(packed, GGUFBlocks) if qtype == "Q5_0" else runner.quantization == "int4"
        assert cpu_ops.variant() == variant
        return llm, LogitsRecorder(llm)

    llm, rec = engine()
    alone = [rec.run(llm, [p])[0] for p in PROMPTS]
    assert len({tuple(a.tokens) for a in alone}) > 3  # the tiny model does depend on its prompt

    for what, got in (
        ("batched", rec.run(llm, PROMPTS)),
        ("batched, reversed", rec.run(llm, PROMPTS[::-1])[::-1]),
    ):
        for i, result in enumerate(got):
            _assert_same(result, alone[i], f"{what}, prompt {i}")

    chunked, rec_chunked = engine(max_num_batched_tokens=16, max_num_seqs=4)
    for i, result in enumerate(rec_chunked.run(chunked, PROMPTS)):
        _assert_same(result, alone[i], f"chunked prefill, prompt {i}")

    # Room for one sequence of max_model_len in steps of 16 tokens (6 blocks of 16 positions without a
    # sliding window; gemma and phi3 window 8 keys, so each sliding group holds at most 3): six prompts
    # growing by 12 tokens cannot all stay, some are recomputed.
    block_bytes = llm.engine_core.runner.kv_bytes_per_block()
    one_sequence = llm.engine_core.kv_cache_manager.max_blocks_per_request(96, 16)
    small, rec_small = engine(kv_cache_memory_bytes=one_sequence * block_bytes, max_num_batched_tokens=16)
    for i, result in enumerate(rec_small.run(small, PROMPTS)):
        _assert_same(result, alone[i], f"preempted, prompt {i}")
    assert small.engine_core.make_stats().num_preemptions > 0
    assert rec_small.recomputed > 0  # rows computed again after a preemption, with the same bits

    # Prompt logprobs skip the prefix cache (every prompt row must be computed): the sampled rows here.
    cached, rec_cached = engine(enable_prefix_caching=True)
    no_prompt_rows = msgspec.structs.replace(PARAMS, prompt_logprobs=None)
    first = rec_cached.run(cached, PROMPTS, no_prompt_rows)
    again = rec_cached.run(cached, PROMPTS, no_prompt_rows)
    for i in range(len(PROMPTS)):
        _assert_same(first[i], alone[i], f"prefix cache (first run, shared prefix), prompt {i}")
        _assert_same(again[i], alone[i], f"prefix cache hit, prompt {i}")
    assert cached.engine_core.make_stats().prefix_cache_hits > 0


def test_seeded_n_samples_repeat_at_any_load(variant: str, tiny_gguf_factory) -> None:
    """The same seeded n=3 request gives the same samples alone, again, and next to other requests."""
    llm = LLM(tiny_gguf_factory("llama", "Q4_1"), cpu_kernels=variant, kv_cache_memory_bytes=8 << 20)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, n=3, seed=11, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.7, max_tokens=14, ignore_eos=True)

    def samples(outputs: list[Any], index: int = 0) -> list[list[int]]:
        return [c.token_ids for c in outputs[index].outputs]

    prompt = {"prompt_token_ids": PROMPTS[0]}
    first = samples(llm.generate([prompt], seeded))
    assert len({tuple(s) for s in first}) > 1  # the three samples differ
    assert samples(llm.generate([prompt], seeded)) == first
    busy = [{"prompt_token_ids": p} for p in PROMPTS[1:]]
    mixed = llm.generate([*busy[:2], prompt, *busy[2:]], [other, other, seeded, other, other, other])
    assert samples(mixed, 2) == first


def test_lora_logits_do_not_depend_on_the_batch(variant: str, tiny_checkpoint_factory, tmp_path) -> None:
    """Adapter tokens in prefills and mixed steps get the fused decode stack's own LoRA kernel: a request on
    an adapter has the same logits alone (its decodes on the stack) and batched with base requests and
    other prompts (its decodes in mixed steps, through the modules), chunked or not."""
    from tests.fixtures.lora import build_peft_adapter

    base = tiny_checkpoint_factory("llama")
    adapter = build_peft_adapter(base, tmp_path / "a", r=8, alpha=16, seed=1)

    def engine(**kwargs: Any) -> tuple[LLM, LogitsRecorder]:
        llm = LLM(
            base,
            cpu_kernels=variant,
            quantization="int4",
            kv_cache_memory_bytes=8 << 20,
            max_model_len=96,
            enable_prefix_caching=False,
            lora_modules={"a": adapter},
            **kwargs,
        )
        return llm, LogitsRecorder(llm)

    def run(llm: LLM, rec: LogitsRecorder, prompts: list[list[int]], names: list[str | None]) -> list[Result]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_name=names)
        return [Result(rec.rows.pop(o.request_id), o.outputs[0].token_ids) for o in outputs]

    llm, rec = engine()
    names: list[str | None] = ["a", None, "a", None, "a", None]
    alone = [run(llm, rec, [p], [n])[0] for p, n in zip(PROMPTS, names, strict=True)]
    assert alone[0].tokens != run(llm, rec, [PROMPTS[0]], [None])[0].tokens  # the adapter matters
    for i, result in enumerate(run(llm, rec, PROMPTS, names)):
        _assert_same(result, alone[i], f"LoRA batched, prompt {i}")
    chunked, rec_chunked = engine(max_num_batched_tokens=16, max_num_seqs=4)
    for i, result in enumerate(run(chunked, rec_chunked, PROMPTS, names)):
        _assert_same(result, alone[i], f"LoRA chunked, prompt {i}")
