"""Sliding-window layers free their KV blocks: a long multi-turn conversation on a tiny Gemma 3 (five
sliding layers of window 8, one global layer) and a tiny Mistral (every layer windowed), read at the KV
cache manager after every step. The sliding groups' blocks in use stop growing past the window while
the global group's grow with the conversation, and the greedy tokens stay transformers' through the
freed blocks and the prefix-cache hits of every later turn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from izh import LLM, SamplingParams
from izh.engine.kv_cache import KVCacheManager
from tests.engine.test_gemma import _hf_greedy

BLOCK = 4
WINDOW = 8  # the tiny checkpoints' sliding_window
BUDGET = 16  # tokens per step: prompts are prefilled in chunks
TURNS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


class BlockCounter:
    """After each schedule, per scheduled request: its tokens after the step and the live blocks of each
    KV cache group (null entries of a sliding group's table not counted)."""

    def __init__(self, llm: LLM) -> None:
        scheduler = llm.engine_core.scheduler
        kv: KVCacheManager = scheduler.kv_cache_manager
        self.records: list[tuple[int, int, list[int]]] = []
        schedule = scheduler.schedule

        def counted() -> Any:
            out = schedule()
            for s in out.scheduled:
                tables = kv.get_group_block_ids(s.request.request_id)
                live = [sum(1 for b in table if b >= 0) for table in tables]
                end = s.num_computed_tokens_before + s.num_scheduled_tokens
                self.records.append((end, s.num_scheduled_tokens, live))
            return out

        scheduler.schedule = counted  # type: ignore[method-assign]


def _conversation(llm: LLM, tokenizer: Any) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """TURNS turns, each prompt the whole conversation so far plus a new user line: (prompts, outputs,
    cached tokens per turn)."""
    prompts, outputs, cached = [], [], []
    history: list[int] = []
    for turn in range(TURNS):
        history = history + tokenizer.encode(f" user says thing number {turn} again and again:").ids
        out = llm.generate([{"prompt_token_ids": history}], GREEDY)[0]
        prompts.append(list(history))
        outputs.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
        history = history + out.outputs[0].token_ids
    return prompts, outputs, cached


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_sliding_blocks_stop_growing_past_the_window(
    kind: str, tiny_checkpoint_factory: Callable[[str], str], tiny_tokenizer: Any
) -> None:
    path = tiny_checkpoint_factory(kind)
    llm = LLM(
        path,
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory_bytes=8 << 20,
    )
    runner = llm.engine_core.runner
    kv = llm.engine_core.kv_cache_manager
    if kind == "gemma3":
        # One global layer, five sliding: six groups of one layer sharing one cache tensor.
        assert kv.group_windows == (None,) + (WINDOW,) * 5
        assert runner.kv_layout.num_tensors == 1
    else:
        assert kv.group_windows == (WINDOW,)
    mc = runner.model_config
    per_block = 2 * runner.kv_layout.num_tensors * BLOCK * mc.num_key_value_heads * mc.head_dim * 4
    assert runner.kv_bytes_per_block() == per_block

    counter = BlockCounter(llm)
    prompts, outputs, cached = _conversation(llm, tiny_tokenizer)
    llm.engine_core.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks  # everything back once the turns are done

    longest = max(end for end, _, _ in counter.records)
    assert longest > 10 * WINDOW
    sliding_bound = -(-(WINDOW - 1 + BUDGET) // BLOCK) + 1
    for end, scheduled, live in counter.records:
        for group, window in enumerate(kv.group_windows):
            if window is None:
                assert live[group] == -(-end // BLOCK)  # the global group holds the whole context
            else:
                # the window of the step's first token plus the step's own tokens, never the context
                assert live[group] <= -(-(WINDOW - 1 + scheduled) // BLOCK) + 1 <= sliding_bound
    decodes = [live for end, scheduled, live in counter.records if scheduled == 1 and end > 4 * WINDOW]
    sliding_group = kv.group_windows.index(WINDOW)
    assert decodes and max(live[sliding_group] for live in decodes) <= -(-WINDOW // BLOCK) + 1

    # Every turn after the first hits the prefix cache (the previous turn's blocks, the sliding groups'
    # last window among them), and the tokens are transformers' all the same.
    assert all(c >= len(p) for c, p in zip(cached[1:], prompts[:-1], strict=True))
    assert outputs == _hf_greedy(path, prompts, GREEDY.max_tokens)
