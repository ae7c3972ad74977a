"""SamplingParams: defaults, normalisation, validation naming the field, msgspec round trips."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from izh.errors import InvalidRequest
from izh.sampling_params import SamplingParams, StructuredOutputsParams, context_room


def test_defaults_are_vllms() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.seed is None and params.logprobs is None and params.prompt_logprobs is None
    assert params.stop == [] and params.stop_token_ids == []
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not params.ignore_eos and not params.include_stop_str_in_output
    assert params.logit_bias is None and params.allowed_token_ids is None
    assert params.structured_outputs is None


def test_default_lists_are_not_shared() -> None:
    first, second = SamplingParams(), SamplingParams()
    first.stop.append("x")
    assert second.stop == []


def test_normalisation() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={"50": -100}).logit_bias == {50: -100.0}  # type: ignore[dict-item]
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (0.9e-5, True), (1e-5, False), (0.7, False)]
)
def test_is_greedy_uses_vllms_epsilon(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 100.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": -math.inf}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -3]}, "allowed_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize(("kwargs", "param"), INVALID)
def test_invalid_values_name_the_param(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in info.value.message
    assert info.value.status_code == 400


def test_validate_catches_values_changed_after_construction() -> None:
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(InvalidRequest) as info:
        params.validate()
    assert info.value.param == "top_p"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"allowed_token_ids": [3, 100]}, "allowed_token_ids"),
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"bad_words_token_ids": [[1], [2, 100]]}, "bad_words_token_ids"),
        (
            {"stop_token_ids": [1], "logit_bias": {5: 1.0, 100: -1.0}, "allowed_token_ids": [100]},
            "logit_bias",
        ),
    ],
)
def test_token_ids_checked_against_vocab(kwargs: dict[str, Any], param: str) -> None:
    params = SamplingParams(**kwargs)  # in range while the vocabulary is unknown
    params.validate(vocab_size=101)
    params.validate_vocab(101)
    with pytest.raises(InvalidRequest) as info:
        params.validate(vocab_size=100)
    assert info.value.param == param
    assert info.value.message == f"{param} contains token id 100, outside [0, 100)"
    # validate_vocab, the frontend's one check, says exactly what the full validate says.
    with pytest.raises(InvalidRequest) as only_vocab:
        params.validate_vocab(100)
    assert (only_vocab.value.message, only_vocab.value.param) == (info.value.message, info.value.param)


def test_max_token_id_is_the_largest_id_of_any_field() -> None:
    assert SamplingParams().max_token_id() == -1
    assert SamplingParams(stop_token_ids=[3], logit_bias={9: 1.0}, allowed_token_ids=[4]).max_token_id() == 9
    assert SamplingParams(allowed_token_ids=[12, 2], bad_words_token_ids=[[1, 7]]).max_token_id() == 12
    assert SamplingParams(bad_words_token_ids=[[1, 70]], stop_token_ids=[5]).max_token_id() == 70


def test_derived_copies_leave_the_original_alone() -> None:
    params = SamplingParams(max_tokens=None, bad_words=["x"])
    resolved = params.with_max_tokens(7)
    assert (resolved.max_tokens, params.max_tokens) == (7, None)
    banned = params.with_bad_words_token_ids(lambda text: [3] if text == "x" else [4, 3], 10)
    assert banned.bad_words_token_ids == [[3], [4, 3]] and params.bad_words_token_ids == []


def test_boundary_values_are_accepted() -> None:
    SamplingParams(
        n=128,
        temperature=100.0,
        top_p=1.0,
        top_k=5,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        max_tokens=1,
        min_tokens=1,
        logprobs=20,
        prompt_logprobs=0,
        logit_bias={0: -100.0, 1: 100.0},
        seed=2**64 - 1,
    ).validate(vocab_size=2)
    SamplingParams(temperature=0.0, min_p=0.0, logprobs=0, seed=-(2**63), max_tokens=None, min_tokens=50)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"json": "{}", "regex": "a+"},
        {"choice": ["a"], "json_object": True},
        {"json": "{not json"},
        {"json": "[1, 2]"},
        {"regex": ""},
        {"choice": []},
        {"grammar": ""},
    ],
)
def test_structured_outputs_needs_exactly_one_valid_constraint(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"


def test_structured_outputs_valid_kinds() -> None:
    for kwargs in (
        {"json": '{"type": "object"}'},
        {"regex": "[0-9]+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'start: "a"'},
        {"json_object": True},
    ):
        spec = StructuredOutputsParams(**kwargs)
        assert SamplingParams(structured_outputs=spec).structured_outputs == spec


def _every_field_set() -> SamplingParams:
    return SamplingParams(
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=2**63 + 5,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 7],
        include_stop_str_in_output=True,
        ignore_eos=True,
        max_tokens=None,
        min_tokens=4,
        logprobs=5,
        prompt_logprobs=2,
        logit_bias={11: -100.0, 12: 3.5},
        allowed_token_ids=[11, 12, 13],
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
    )


@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json])
def test_msgspec_round_trip(codec: Any) -> None:
    params = _every_field_set()
    decoded = codec.decode(codec.encode(params), type=SamplingParams)
    assert decoded == params
    assert decoded.logit_bias == {11: -100.0, 12: 3.5}


def test_defaults_are_omitted_on_the_wire() -> None:
    assert msgspec.json.encode(SamplingParams()) == b"{}"
    assert msgspec.json.decode(b"{}", type=SamplingParams) == SamplingParams()


def test_decoding_validates() -> None:
    with pytest.raises(InvalidRequest) as info:
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)
    assert info.value.param == "top_p"
    assert msgspec.json.decode(b'{"top_k": -1}', type=SamplingParams).top_k == 0


def test_clone_is_deep() -> None:
    params = _every_field_set()
    clone = params.clone()
    assert clone == params and clone is not params
    clone.stop.append("more")
    assert clone.logit_bias is not None and clone.structured_outputs is not None
    clone.logit_bias[99] = 1.0
    assert clone.structured_outputs.choice is not None
    clone.structured_outputs.choice.append("c")
    assert params == _every_field_set()


def test_importing_does_not_import_torch() -> None:
    code = "import sys, izh.sampling_params; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_one_n_to_children_rule() -> None:
    params = SamplingParams(n=3, seed=5, stop=["x"])
    children = [params.child(k) for k in range(params.n)]
    assert [(c.n, c.seed) for c in children] == [(1, 5), (1, 6), (1, 7)]  # seeded samples still differ
    assert params.n == 3 and params.seed == 5 and children[1].stop == ["x"]
    unseeded = SamplingParams(n=2)
    assert [unseeded.child(k).seed for k in range(2)] == [None, None]


def test_the_room_a_prompt_leaves() -> None:
    assert context_room(16, 10) == 6
    assert context_room(16, 16) == 0 and context_room(16, 17) == -1
