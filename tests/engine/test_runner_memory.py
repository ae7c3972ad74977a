"""What the model runner keeps resident beyond the weights and the KV pool: the logits buffer grows with
the batch instead of holding max_num_seqs rows from the start, RoPE's cos/sin cache holds the served
context's positions only, and the offline LLM shares the core's tokenizer (bench_results/README.md, the
GGUF memory section, measures what these save on a real file)."""

from __future__ import annotations

from collections.abc import Callable

from izh import LLM, SamplingParams
from izh.model.layers import RotaryEmbedding


def test_logits_buffer_rope_cache_and_tokenizer_fit_what_is_served(
    tiny_gguf_factory: Callable[..., str],
) -> None:
    llm = LLM(tiny_gguf_factory("llama", "Q8_0"), max_model_len=96, max_num_seqs=16, dtype="float32")
    runner = llm.engine_core.runner
    assert llm.tokenizer is llm.engine_core.tokenizer
    ropes = [m for m in runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(m.cos_sin_cache.shape[0] == 96 for m in ropes)

    # After the warm-up (one sampled row per step) the buffer holds one row.
    assert runner.logits_buffer(1).shape[0] == 1
    alone = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert runner.logits_buffer(1).shape[0] == 1
    # Five rows need the next power of two; more than max_num_seqs rows get no buffer.
    assert runner.logits_buffer(5).shape[0] == 8
    assert runner.logits_buffer(12).shape[0] == 16
    assert runner.logits_buffer(17) is None
    # A batch after the growth still gives the lone request's tokens.
    batch = llm.generate(
        ["hello there", "a b c d e", "one two", "x"],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    assert batch[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
