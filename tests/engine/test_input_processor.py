"""The one door into the engine core (izh.frontend.input_processor.process_request) and its validation
point (validate_request), without an engine.

The exact messages and params of its refusals are pinned through AsyncLLM in test_async_llm.py
(VALIDATION_ERRORS); here, what it returns and the edges of the context length."""

from __future__ import annotations

import pytest

from izh.engine_messages import AddRequest, ImageInput
from izh.errors import ContextLengthExceeded, InvalidRequest
from izh.frontend.input_processor import ModelFacts, process_request, validate_request
from izh.sampling_params import SamplingParams, StructuredOutputsParams, context_room

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


FACTS = ModelFacts(model_name="tiny", vocab_size=VOCAB, max_model_len=16)


def test_process_request_returns_the_validated_add_request() -> None:
    params = SamplingParams(max_tokens=None, seed=3)
    request = process_request("r", [1, 2, 3], params, FACTS, priority=2, cache_salt="s", lora_name="adapter")
    assert isinstance(request, AddRequest)
    assert (request.request_id, request.prompt_token_ids, request.priority) == ("r", [1, 2, 3], 2)
    assert (request.cache_salt, request.lora_name, request.images) == ("s", "adapter", None)
    # The params validate_request returns: max_tokens resolved to the room the prompt leaves.
    assert request.sampling_params.max_tokens == context_room(16, 3) == 13 and params.max_tokens is None
    with pytest.raises(ContextLengthExceeded) as info:
        process_request("r", [1] * 10, SamplingParams(max_tokens=7), FACTS, prompt_param="messages")
    assert info.value.param == "max_tokens" and "10 in the messages" in info.value.message


def test_process_request_checks_images_against_the_model() -> None:
    image = ImageInput(pixel_values=b"", shape=(0, 3, 4, 4), offset=1, length=1, content_hash="")
    with pytest.raises(InvalidRequest, match=r"this model \(tiny\) takes no images") as info:
        process_request("r", [1, 2], SamplingParams(), FACTS, images=[image], prompt_param="messages")
    assert info.value.param == "messages"
    vlm = ModelFacts(model_name="vlm", vocab_size=VOCAB, max_model_len=16, image_token_id=7)
    with pytest.raises(InvalidRequest, match="image placeholder token but no image"):
        process_request("r", [1, 7, 2], SamplingParams(), vlm)
    assert process_request("r", [1, 2], SamplingParams(max_tokens=1), vlm).sampling_params.max_tokens == 1
