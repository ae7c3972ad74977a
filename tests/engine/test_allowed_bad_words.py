"""allowed_token_ids and bad_words through the offline engine (tiny random Llama) against a torch
reference written out below: transformers' logits, the masks applied one step at a time, argmax.

As in vLLM, the masks shape what is sampled but not the logprobs, which stay the raw model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from izh import LLM, SamplingParams
from izh.engine.sampler import SamplingMetadata, SamplingRow, apply_token_masks
from izh.errors import InvalidRequest
from izh.sampling_params import MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS

MAX_TOKENS = 12
PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: str) -> Iterator[torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    yield model


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: str) -> HFTokenizer:
    return HFTokenizer.from_file(f"{tiny_llama_dir}/tokenizer.json")


# ---- the reference ---------------------------------------------------------------------------------


def reference_bad_word_sequences(tokenizer: HFTokenizer, words: Sequence[str]) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer, each word stripped on the left, as is and with
    a leading space; the spaced form is kept even when its length differs (vLLM drops it then)."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if ids not in sequences:
                sequences.append(ids)
    return sequences


def reference_greedy(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    allowed: Sequence[int] | None = None,
    bad_sequences: Sequence[Sequence[int]] = (),
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens under the masks, and each step's raw log-softmax (the logprobs vLLM reports)."""
    output: list[int] = []
    raw_logprobs: list[torch.Tensor] = []
    for _ in range(MAX_TOKENS):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + output])).logits[0, -1].float()  # [vocab_size]
        raw_logprobs.append(torch.log_softmax(logits, dim=-1))
        masked = logits.clone()
        if allowed is not None:
            keep = torch.zeros_like(masked, dtype=torch.bool)
            keep[list(allowed)] = True
            masked[~keep] = -math.inf
        for sequence in bad_sequences:
            *prefix, last = sequence
            # Only the output counts: a word begun in the prompt is not banned (vLLM's rule).
            if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                masked[last] = -math.inf
        output.append(int(masked.argmax()))
    return output, raw_logprobs


def _greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3, **kwargs)  # type: ignore[arg-type]


def _assert_raw_logprobs(completion: object, raw_logprobs: list[torch.Tensor]) -> None:
    logprobs = completion.logprobs  # type: ignore[attr-defined]
    assert logprobs is not None and len(logprobs) == len(raw_logprobs)
    for entry, raw in zip(logprobs, raw_logprobs, strict=True):
        chosen = entry.chosen.token_id
        assert math.isclose(entry.chosen.logprob, raw[chosen].item(), abs_tol=1e-4)
        assert entry.rank == 1 + int((raw > raw[chosen]).sum())
        assert [t.token_id for t in entry.top] == raw.topk(3).indices.tolist()


# ---- allowed_token_ids ---------------------------------------------------------------------------------


def test_allowed_token_ids_greedy_equals_the_reference(llm: LLM, hf_model: torch.nn.Module) -> None:
    free = llm.generate(PROMPTS, _greedy())
    allowed_per_prompt = [
        # The free output's own tokens but its first, plus a few others.
        sorted(set(out.outputs[0].token_ids[1:]) | {5, 77, 300})
        for out in free
    ]
    # One batch, each row with its own allow-list (and one row without).
    params = [_greedy(allowed_token_ids=allowed) for allowed in allowed_per_prompt[:2]] + [_greedy()]
    outputs = llm.generate(PROMPTS, params)
    for out, allowed in zip(outputs, [*allowed_per_prompt[:2], None], strict=True):
        expected, raw_logprobs = reference_greedy(hf_model, out.prompt_token_ids, allowed=allowed)
        completion = out.outputs[0]
        assert completion.token_ids == expected
        if allowed is not None:
            assert set(completion.token_ids) <= set(allowed)
        # Logprobs are the raw model's: the top ones include tokens outside the allow-list.
        _assert_raw_logprobs(completion, raw_logprobs)
    assert outputs[0].outputs[0].token_ids != free[0].outputs[0].token_ids


def test_allowed_token_ids_hold_when_sampling(llm: LLM) -> None:
    allowed = [3, 40, 41, 42, 500]
    params = SamplingParams(
        temperature=1.5, seed=7, max_tokens=64, ignore_eos=True, allowed_token_ids=allowed
    )
    outputs = llm.generate(PROMPTS, params)
    sampled = {token for out in outputs for token in out.outputs[0].token_ids}
    assert sampled <= set(allowed) and len(sampled) > 1


# ---- bad_words -------------------------------------------------------------------------------------


def test_bad_words_greedy_equals_the_reference(
    llm: LLM, hf_model: torch.nn.Module, hf_tokenizer: HFTokenizer
) -> None:
    free = llm.generate(PROMPTS, _greedy())
    # Words the free outputs wrote (" if", " than" then "ly", " man", "hi"), one-token and two-token.
    words = [["if"], ["than", "thanly"], ["man", "hi"]]
    outputs = llm.generate(PROMPTS, [_greedy(bad_words=w) for w in words])
    changed = 0
    for out, free_out, bad in zip(outputs, free, words, strict=True):
        sequences = reference_bad_word_sequences(hf_tokenizer, bad)
        expected, raw_logprobs = reference_greedy(hf_model, out.prompt_token_ids, bad_sequences=sequences)
        completion = out.outputs[0]
        assert completion.token_ids == expected, bad
        _assert_raw_logprobs(completion, raw_logprobs)
        for word in bad:
            assert f" {word}" not in completion.text and not completion.text.startswith(word)
        changed += completion.token_ids != free_out.outputs[0].token_ids
    assert changed == len(PROMPTS)  # every word list was in the way of its free output


def test_a_bad_sequence_is_banned_only_after_its_prefix(llm: LLM, hf_model: torch.nn.Module) -> None:
    prompt = PROMPTS[1]
    free = llm.generate([prompt], _greedy())[0]
    prompt_ids, free_ids = free.prompt_token_ids, free.outputs[0].token_ids
    cases = [
        [free_ids[3:5]],  # banned at step 4, once the output ends with free_ids[3]
        [[free_ids[0]]],  # one token: banned from the first step
        [[prompt_ids[-1], free_ids[0]]],  # its prefix is the prompt's: never banned
        [free_ids[2:5], [free_ids[6]]],
    ]
    outputs = llm.generate([prompt] * len(cases), [_greedy(bad_words_token_ids=c) for c in cases])
    for out, sequences in zip(outputs, cases, strict=True):
        expected, _ = reference_greedy(hf_model, prompt_ids, bad_sequences=sequences)
        assert out.outputs[0].token_ids == expected, sequences
    assert outputs[0].outputs[0].token_ids[:4] == free_ids[:4] != outputs[0].outputs[0].token_ids[:5]
    assert outputs[1].outputs[0].token_ids[0] != free_ids[0]
    assert outputs[2].outputs[0].token_ids == free_ids


def test_bad_words_and_allowed_token_ids_together(
    llm: LLM, hf_model: torch.nn.Module, hf_tokenizer: HFTokenizer
) -> None:
    free = llm.generate([PROMPTS[0]], _greedy())[0]
    allowed = sorted(set(free.outputs[0].token_ids) | {9, 10, 11})
    out = llm.generate([PROMPTS[0]], _greedy(allowed_token_ids=allowed, bad_words=["if"]))[0]
    sequences = reference_bad_word_sequences(hf_tokenizer, ["if"])
    expected, _ = reference_greedy(hf_model, out.prompt_token_ids, allowed=allowed, bad_sequences=sequences)
    assert out.outputs[0].token_ids == expected
    assert set(expected) <= set(allowed) and not {s[0] for s in sequences if len(s) == 1} & set(expected)


def test_batched_masks_equal_the_reference_row_by_row() -> None:
    vocab_size = 40
    rows = [
        ([[5], [7, 8], [1, 2, 9]], [3, 1, 2], None),  # 5 always; 9 after [1, 2]; 8 not (ends in 2)
        ([[7, 8], [2, 7, 11]], [6, 2, 7], [7, 8, 11, 30]),  # 8 and 11, then the allow-list
        ([[4, 4]], [], None),  # a prefix longer than the output: nothing yet
        ([], [1], [0, 1]),
        ([[12]], [12, 12], None),
    ]
    sampling_rows = [
        SamplingRow(
            SamplingParams(bad_words_token_ids=sequences, allowed_token_ids=allowed),
            [1, 2, 3],
            output,
            frozenset(),
        )
        for sequences, output, allowed in rows
    ]
    logits = torch.randn(len(rows), vocab_size, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    metadata = SamplingMetadata.build(sampling_rows, vocab_size, "cpu")
    masked = apply_token_masks(logits.clone(), metadata)
    for i, (sequences, output, allowed) in enumerate(rows):
        expected = logits[i].clone()
        if allowed is not None:
            expected[[t for t in range(vocab_size) if t not in allowed]] = -math.inf
        for *prefix, last in sequences:
            if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
                expected[last] = -math.inf
        assert torch.equal(masked[i], expected), i
    assert masked[0, 5] == masked[0, 9] == -math.inf and math.isfinite(masked[0, 8])
    assert torch.isfinite(masked[2]).all()


# ---- what the engine makes of bad_words, and bad input --------------------------------------------


def test_the_engine_tokenizes_each_bad_word_with_and_without_a_space(
    llm: LLM, hf_tokenizer: HFTokenizer
) -> None:
    words = ["if", "  than", "thanly", "zzzz", "hello world"]
    params = SamplingParams(bad_words=words, bad_words_token_ids=[[7, 8]])
    resolved = params.with_bad_words_token_ids(
        lambda text: llm.tokenizer.encode(text, add_special_tokens=False), llm.engine_core.vocab_size
    )
    assert resolved.bad_words_token_ids == [[7, 8], *reference_bad_word_sequences(hf_tokenizer, words)]
    assert params.bad_words_token_ids == [[7, 8]]  # the original is left alone
    # Ids past the logits can never be generated: such a sequence is left out.
    beyond = params.with_bad_words_token_ids(lambda text: [1, 10**6], llm.engine_core.vocab_size)
    assert beyond.bad_words_token_ids == [[7, 8]]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, True]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, 10**6]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["ok", " \n "]}, "bad_words"),
        ({"bad_words": [f"w{i}" for i in range(MAX_BAD_WORDS + 1)]}, "bad_words"),
        ({"bad_words": ["x" * (MAX_BAD_WORDS_CHARS + 1)]}, "bad_words"),
    ],
)
def test_bad_input_is_refused(llm: LLM, fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        llm.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=2, **fields))  # type: ignore[arg-type]
    assert err.value.param == param and err.value.status_code == 400
