"""The real Gemma 3 270M Q4_K_M (`izh pull gemma3`) against transformers on the same GGUF in float32:
greedy chat replies equal, a divergence accepted only where transformers' top-2 are a near-tie. (The
file is the pretrained google/gemma-3-270m, not the instruction-tuned one: its chat replies are poor,
the comparison is what counts.)"""

from __future__ import annotations

import pytest

from izh import LLM, SamplingParams
from izh.tokenizer import load_tokenizer
from tests.fixtures.gemma3 import (
    GEMMA3_CHATS,
    NUM_GENERATED,
    first_divergence_is_a_near_tie,
    gemma3_hf_references,
)

# Two 270M-parameter models in float32 on a small shared CPU: minutes, not seconds.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_gemma3_chat_greedy_equals_transformers(gemma3_gguf: str) -> None:
    tokenizer = load_tokenizer(gemma3_gguf)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(chat, add_generation_prompt=True), add_special_tokens=False
        )
        for chat in GEMMA3_CHATS
    ]
    references = gemma3_hf_references(gemma3_gguf, prompts)
    # float32 and dense weights, as transformers runs the dequantized file.
    llm = LLM(
        gemma3_gguf, dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=512
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GENERATED, ignore_eos=True)
    outputs = llm.chat(GEMMA3_CHATS, params)
    for reference, out in zip(references, outputs, strict=True):
        assert out.prompt_token_ids == reference.prompt_ids
        assert first_divergence_is_a_near_tie(reference, out.outputs[0].token_ids), (reference, out)
    llm.engine_core.check_invariants()
