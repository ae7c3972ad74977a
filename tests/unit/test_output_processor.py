"""OutputProcessor: detokenized deltas, stop strings across token boundaries, held-back text, logprobs.

A real byte-level BPE tokenizer (trained here with `tokenizers` on a small corpus) produces the
token ids; the engine outputs are fed one token per step like the core sends them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from izh.engine_messages import EngineOutput, TokenLogprobs
from izh.frontend.output_processor import OutputProcessor, RequestOutput, RequestState
from izh.sampling_params import SamplingParams
from izh.tokenizer import Tokenizer
from tests.fixtures.bpe import train_byte_level_bpe

CORPUS = [
    "Hello world, stop here and more text follows.",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Emoji 😀 👍🏽 and CJK 你好世界 and accents café naïve résumé",
    "STOP words: the end. THE END. The End!",
    "<|endoftext|>",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = train_byte_level_bpe(CORPUS, 600, ["<|endoftext|>"])
    return Tokenizer(backend, special_tokens={"eos_token": "<|endoftext|>"})


@pytest.fixture(scope="module")
def processor(tokenizer: Tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer)


def _state(processor: OutputProcessor, **params: object) -> RequestState:
    return processor.make_request_state("req-1", [1, 2, 3], SamplingParams(**params), arrival_time=0.0)  # type: ignore[arg-type]


def _stream(
    processor: OutputProcessor,
    state: RequestState,
    token_ids: list[int],
    *,
    finish_reason: str | None = "length",
    stop_reason: int | None = None,
) -> list[RequestOutput]:
    """Feed one token per step; the last step carries the engine's finish_reason. Stops at the
    first finished output (the frontend ignores the core's later outputs of a finished request)."""
    outputs = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1
        eo = EngineOutput(
            request_id=state.request_id,
            new_token_ids=[token_id],
            finish_reason=finish_reason if last else None,
            stop_reason=stop_reason if last else None,
            num_prompt_tokens=3,
        )
        out = processor.process(state, eo, now=float(i + 1))
        outputs.append(out)
        if out.finished:
            break
    return outputs


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(out.text for out in outputs)


def test_deltas_concatenate_to_the_decoded_text(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "The quick brown fox 😀 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = _state(processor)
    outputs = _stream(processor, state, ids)
    assert _text(outputs) == text
    assert [t for out in outputs for t in out.token_ids] == ids
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert all(not out.finished for out in outputs[:-1])
    assert [out.num_output_tokens for out in outputs] == list(range(1, len(ids) + 1))
    assert state.metrics.num_generation_tokens == len(ids)
    assert state.metrics.first_token_time == 1.0 and state.metrics.last_token_time == float(len(ids))


def test_stop_string_split_across_tokens(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "Hello world, stop here and more text follows."
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = [tokenizer.decode([i]) for i in ids]
    assert "stop here" not in tokens  # the stop string spans several tokens
    state = _state(processor, stop=["stop here"])
    outputs = _stream(processor, state, ids)
    assert _text(outputs) == "Hello world, "
    final = outputs[-1]
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == "stop here"
    assert state.stop_hit
    # It ended at the token completing the stop string, before the engine finished.
    assert len(outputs) < len(ids)


def test_include_stop_str_in_output(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "Hello world, stop here and more text follows."
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = _state(processor, stop=["stop here"], include_stop_str_in_output=True)
    outputs = _stream(processor, state, ids)
    assert _text(outputs) == "Hello world, stop here"
    assert outputs[-1].stop_reason == "stop here"


def test_earliest_stop_string_wins(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    ids = tokenizer.encode("Hello world, stop here and more", add_special_tokens=False)
    state = _state(processor, stop=["more", "world", "stop"])
    outputs = _stream(processor, state, ids)
    assert _text(outputs) == "Hello "
    assert outputs[-1].stop_reason == "world"


def test_stop_completed_inside_one_token_prefers_earliest_start(processor: OutputProcessor) -> None:
    tokenizer = processor.tokenizer
    ids = tokenizer.encode("the end", add_special_tokens=False)
    state = _state(processor, stop=["end", "the end"])
    assert _text(_stream(processor, state, ids)) == ""


def test_nothing_after_a_stop_leaks_into_any_delta(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = _state(processor, stop=["lazy dog", "jumps over the"])
    outputs = _stream(processor, state, ids)
    expected = "The quick brown fox "
    streamed = ""
    for out in outputs:
        streamed += out.text
        assert expected.startswith(streamed), streamed
        assert "jump" not in out.text
    assert streamed == expected


def test_held_back_text_is_released_at_finish(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "Hello world"
    ids = tokenizer.encode(text, add_special_tokens=False)
    state = _state(processor, stop=["world, stop"])  # "world" could be its start: held back
    outputs = _stream(processor, state, ids, finish_reason="length")
    assert "world" not in _text(outputs[:-1])
    assert _text(outputs) == text
    assert outputs[-1].finish_reason == "length" and outputs[-1].stop_reason is None


def test_frontend_finish_releases_held_back_text(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    state = _state(processor, stop=["world, stop"])
    outputs = _stream(processor, state, ids, finish_reason=None)
    final = processor.finish(state, "length", now=99.0)
    assert final.finished and final.finish_reason == "length" and final.token_ids == []
    assert _text([*outputs, final]) == "Hello world"
    assert state.metrics.finish_reason == "length" and state.metrics.finished_time == 99.0


def test_stop_strings_wait_for_min_tokens(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "THE END. The End!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first_end = len(tokenizer.encode("THE END", add_special_tokens=False))
    state = _state(processor, stop=["END", "End"], min_tokens=first_end)
    outputs = _stream(processor, state, ids)
    assert _text(outputs) == "THE END. The "
    assert outputs[-1].stop_reason == "End"


def test_stop_token_is_not_in_the_text_unless_asked(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    stop_id = ids[-1]
    state = _state(processor, stop_token_ids=[stop_id])
    outputs = _stream(processor, state, ids, finish_reason="stop", stop_reason=stop_id)
    assert _text(outputs) == tokenizer.decode(ids[:-1])
    assert outputs[-1].stop_reason == stop_id and outputs[-1].token_ids == [stop_id]

    state = _state(processor, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    outputs = _stream(processor, state, ids, finish_reason="stop", stop_reason=stop_id)
    assert _text(outputs) == "Hello world"


def test_utf8_split_across_tokens(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "party 🎉 ǅ 你好"  # 🎉 and ǅ are not in the corpus: their bytes stay separate tokens
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(not _is_utf8(tokenizer.token_bytes(i)) for i in ids), "a character must span tokens"
    for params in ({}, {"stop": ["zz"]}):
        outputs = _stream(processor, _state(processor, **params), ids)
        assert all("\ufffd" not in out.text for out in outputs)
        assert _text(outputs) == text


def test_stop_string_across_a_split_character(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    text = "party 🎉 ǅ and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    outputs = _stream(processor, _state(processor, stop=["🎉 ǅ"]), ids)
    assert _text(outputs) == "party "
    assert outputs[-1].stop_reason == "🎉 ǅ"


def test_logprob_token_strings(tokenizer: Tokenizer, processor: OutputProcessor) -> None:
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    assert len(hello) == 1
    emoji_bytes = tokenizer.encode("🎉", add_special_tokens=False)
    partial = next(i for i in emoji_bytes if not _is_utf8(tokenizer.token_bytes(i)))
    state = _state(processor, logprobs=2, prompt_logprobs=1)
    eo = EngineOutput(
        request_id=state.request_id,
        new_token_ids=hello,
        new_logprobs=[
            TokenLogprobs(token_id=hello[0], logprob=-0.25, rank=1, top=[(hello[0], -0.25), (partial, -2.0)])
        ],
        prompt_logprobs=[None, TokenLogprobs(token_id=hello[0], logprob=-3.0, rank=7)],
    )
    out = processor.process(state, eo, now=1.0)
    assert out.logprobs is not None and len(out.logprobs) == 1
    position = out.logprobs[0]
    assert (position.chosen.token, position.chosen.logprob, position.rank) == ("Hello", -0.25, 1)
    assert position.chosen.token_bytes == list(b"Hello")
    assert [t.token_id for t in position.top] == [hello[0], partial]
    raw = tokenizer.token_bytes(partial)
    assert position.top[1].token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    assert position.top[1].token_bytes == list(raw)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1] is not None and out.prompt_logprobs[1].rank == 7

    later = processor.process(state, EngineOutput(request_id=state.request_id, new_token_ids=hello), now=2.0)
    assert later.prompt_logprobs is None and later.logprobs is None


def test_core_error_finishes_the_request(processor: OutputProcessor) -> None:
    state = _state(processor)
    eo = EngineOutput(
        request_id=state.request_id, new_token_ids=[], finish_reason="error", error="bad", error_code=400
    )
    out = processor.process(state, eo, now=1.0)
    assert out.finished and out.finish_reason == "error"
    assert (out.error, out.error_code) == ("bad", 400)
    assert state.finished and state.metrics.finish_reason == "error"


def test_merge_folds_later_deltas(processor: OutputProcessor) -> None:
    first = RequestOutput(request_id="r", text="ab", token_ids=[1, 2], num_output_tokens=2)
    second = RequestOutput(
        request_id="r", text="c", token_ids=[3], finished=True, finish_reason="length", num_output_tokens=3
    )
    first.merge(second)
    assert (first.text, first.token_ids, first.finished, first.finish_reason) == (
        "abc",
        [1, 2, 3],
        True,
        "length",
    )
    assert first.num_output_tokens == 3


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _reference(text_after_each_token: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    """vLLM's rule: the first token whose text completes any stop string ends the request there,
    cut at the earliest such occurrence (ties: the first listed)."""
    for i, text in enumerate(text_after_each_token):
        previous = text_after_each_token[i - 1] if i else ""
        found = [
            (index, order, stop)
            for order, stop in enumerate(stops)
            if (index := text.find(stop, max(0, len(previous) - len(stop) + 1))) >= 0
        ]
        if found:
            index, _, stop = min(found)
            return text[: index + len(stop)] if include else text[:index], stop
    return text_after_each_token[-1] if text_after_each_token else "", None


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["the", " end", " END", ",", " fox", " 🎉", "dog", ".", " "]), min_size=1, max_size=12
    ),
    stops=st.lists(
        st.sampled_from(["end", "the e", "d,", "🎉", "x d", "o", ". ", "dog."]), min_size=1, max_size=3
    ),
    include=st.booleans(),
)
def test_stop_strings_match_the_reference(
    processor: OutputProcessor, words: list[str], stops: list[str], include: bool
) -> None:
    tokenizer = processor.tokenizer
    ids = tokenizer.encode("".join(words), add_special_tokens=False)
    texts = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # The reference works on whole characters: skip cut points inside a split character.
    texts = [t for t in texts if "\ufffd" not in t]
    expected_text, expected_stop = _reference(texts, stops, include)
    state = _state(processor, stop=stops, include_stop_str_in_output=include)
    outputs = _stream(processor, state, ids)
    streamed = ""
    for out in outputs:
        streamed += out.text
        assert expected_text.startswith(streamed)
    assert streamed == expected_text
    assert outputs[-1].stop_reason == expected_stop
