"""Mistral with a sliding window (8 keys, far shorter than the prompts) against transformers: prefill
logits, and greedy tokens through the engine batched, alone, in chunks and from the prefix cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from izh import LLM, SamplingParams
from izh.model import AttentionMetadata, load_model
from tests.engine.test_gemma import PROMPTS, _hf_greedy, _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_mistral_matches_transformers(tiny_checkpoint_factory: Callable[[str], str], tiny_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint_factory("mistral")
    prompts = [tiny_tokenizer.encode(p).ids for p in PROMPTS]
    ours, config = load_model(path, dtype=torch.float32)
    assert (config.architecture, config.sliding_window) == ("mistral", 8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.inference_mode():
        logits = ours.compute_logits(
            ours(flat, positions, AttentionMetadata.for_prefill(list(map(len, prompts))))
        )
        start = 0
        for ids in prompts:
            assert (logits[start : start + len(ids)] - hf(torch.tensor([ids])).logits[0]).abs().max() < 1e-4
            start += len(ids)

    expected = _hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == expected  # prefix-cache hits now
    chunked = LLM(
        path, dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=5, max_num_seqs=2
    )
    assert _tokens(chunked.generate(PROMPTS, GREEDY)) == expected
    llm.engine_core.check_invariants()
