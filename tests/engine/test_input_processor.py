"""The one validation point (izh.frontend.input_processor.validate_request), without an engine.

The exact messages and params of its refusals are pinned through AsyncLLM in test_async_llm.py
(VALIDATION_ERRORS); here, what it returns and the edges of the context length."""

from __future__ import annotations

import pytest

from izh.errors import ContextLengthExceeded, InvalidRequest
from izh.frontend.input_processor import validate_request
from izh.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 100


def check(prompt: list[int], params: SamplingParams, max_model_len: int = 16) -> SamplingParams:
    return validate_request(prompt, params, vocab_size=VOCAB, max_model_len=max_model_len)


def test_max_tokens_none_takes_the_room_left_and_leaves_the_params_alone() -> None:
    params = SamplingParams(max_tokens=None, min_tokens=6)
    resolved = check([1] * 10, params)
    assert resolved.max_tokens == 6 and params.max_tokens is None
    explicit = SamplingParams(max_tokens=6)
    assert check([1] * 10, explicit) is explicit


def test_the_context_length_edges() -> None:
    assert check([1] * 15, SamplingParams(max_tokens=1)).max_tokens == 1
    assert check([1] * 15, SamplingParams(max_tokens=None)).max_tokens == 1
    assert check([1] * 16, SamplingParams(max_tokens=0)).max_tokens == 0  # a prompt-only request fills it
    for prompt_len, max_tokens in ((16, 1), (16, None), (15, 2), (17, 0)):
        with pytest.raises(ContextLengthExceeded):
            check([1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def test_token_ids_at_the_vocabulary_edge() -> None:
    check([0, VOCAB - 1], SamplingParams(max_tokens=1, stop_token_ids=[VOCAB - 1], logit_bias={0: 1.0}))
    for params in (
        SamplingParams(max_tokens=1, allowed_token_ids=[VOCAB]),
        SamplingParams(max_tokens=1, bad_words_token_ids=[[VOCAB]]),
    ):
        with pytest.raises(InvalidRequest):
            check([1], params)
    with pytest.raises(InvalidRequest, match="out of range"):
        check([VOCAB], SamplingParams(max_tokens=1))


def test_structured_outputs_specs_are_checked() -> None:
    good = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert check([1], good) is good
    bad = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(grammar="start: missing"))
    with pytest.raises(InvalidRequest) as info:
        check([1], bad)
    assert info.value.param == "structured_outputs" and "missing" in info.value.message
