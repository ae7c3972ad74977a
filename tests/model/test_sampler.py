"""The batched sampler against a plain per-row reference written out below."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import msgspec
import pytest
import torch

from izh.engine.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    TokenLogprobs,
    apply_min_p,
    apply_penalties,
    apply_token_masks,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    make_generator,
)
from izh.sampling_params import SamplingParams

EOS = 0
NEG_INF = -math.inf


def make_row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: frozenset[int] = frozenset({EOS}),
) -> SamplingRow:
    generator = make_generator(params.seed, "cpu") if params.seed is not None else None
    return SamplingRow(params, list(prompt), list(output), eos, generator)


def random_logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


# ---- the reference: one row at a time, plain Python over the vocabulary ----


def ref_masks(logits: list[float], row: SamplingRow) -> list[float]:
    params = row.params
    out = list(logits)
    if params.allowed_token_ids is not None:
        out = [x if t in params.allowed_token_ids else NEG_INF for t, x in enumerate(out)]
    for token_id, bias in (params.logit_bias or {}).items():
        out[token_id] += bias
    if len(row.output_token_ids) < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(row.eos_token_ids))
        for token_id in banned:
            out[token_id] = NEG_INF
    return out


def ref_penalties(logits: list[float], row: SamplingRow) -> list[float]:
    params = row.params
    counts = Counter(row.output_token_ids)
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    out = []
    for token_id, x in enumerate(logits):
        if token_id in seen:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        x -= params.frequency_penalty * counts[token_id]
        x -= params.presence_penalty * (1 if counts[token_id] else 0)
        out.append(x)
    return out


def ref_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def ref_top_k(logits: list[float], top_k: int) -> list[float]:
    if top_k <= 0 or top_k >= len(logits):
        return list(logits)
    kth = sorted(logits, reverse=True)[top_k - 1]
    return [x if x >= kth else NEG_INF for x in logits]


def ref_top_p(logits: list[float], top_p: float) -> list[float]:
    probs = ref_softmax(logits)
    kept: set[int] = set()
    cumulative = 0.0
    for token_id in sorted(range(len(probs)), key=lambda t: (-probs[t], t)):
        if cumulative >= top_p:
            break
        kept.add(token_id)
        cumulative += probs[token_id]
    return [x if t in kept else NEG_INF for t, x in enumerate(logits)]


def ref_top_k_top_p(logits: torch.Tensor, settings: Sequence[tuple[int, float]]) -> list[list[float]]:
    """Row i: top-k, then top-p (1.0 = off), by `settings[i]` = (top_k, top_p)."""
    expected = []
    for i, (top_k, top_p) in enumerate(settings):
        row = ref_top_k(logits[i].tolist(), top_k)
        expected.append(ref_top_p(row, top_p) if top_p < 1.0 else row)
    return expected


def ref_min_p(probs: list[float], min_p: float) -> list[float]:
    threshold = max(probs) * min_p
    return [p if p >= threshold else 0.0 for p in probs]


def ref_distribution(logits: list[float], row: SamplingRow) -> list[float]:
    """The probability of each next token under the row's whole pipeline."""
    params = row.params
    processed = ref_penalties(ref_masks(logits, row), row)
    if params.is_greedy:
        best = processed.index(max(processed))
        return [1.0 if t == best else 0.0 for t in range(len(processed))]
    scaled = ref_top_k([x / params.temperature for x in processed], params.top_k)
    if params.top_p < 1.0:
        scaled = ref_top_p(scaled, params.top_p)
    probs = ref_softmax(scaled)
    if params.min_p > 0:
        probs = ref_min_p(probs, params.min_p)
    total = sum(probs)
    return [p / total for p in probs]


def assert_same_logits(actual: torch.Tensor, expected: list[list[float]]) -> None:
    expected_tensor = torch.tensor(expected, dtype=torch.float32)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected_tensor))
    torch.testing.assert_close(actual, expected_tensor, rtol=1e-5, atol=1e-5)


# ---- masks, penalties and filters ----


def test_token_masks_match_reference() -> None:
    vocab_size = 20
    rows = [
        make_row(SamplingParams()),
        make_row(SamplingParams(allowed_token_ids=[3, 5, 0, 19])),
        make_row(SamplingParams(logit_bias={1: 5.0, 7: -100.0, 19: 0.5})),
        make_row(SamplingParams(min_tokens=3, stop_token_ids=[4, 9]), output=[1, 2], eos=frozenset({0, 18})),
        make_row(SamplingParams(min_tokens=3, stop_token_ids=[4]), output=[1, 2, 3]),  # reached
        make_row(SamplingParams(min_tokens=2, stop_token_ids=[4], ignore_eos=True)),
        make_row(
            SamplingParams(allowed_token_ids=[1, 2, 3], logit_bias={2: 3.0, 8: 1.0}, min_tokens=1),
            eos=frozenset({2}),
        ),
    ]
    logits = random_logits(len(rows), vocab_size)
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    actual = apply_token_masks(logits.clone(), metadata)
    assert_same_logits(actual, [ref_masks(logits[i].tolist(), row) for i, row in enumerate(rows)])
    # Spot checks of the semantics the reference encodes.
    assert actual[3, 0] == NEG_INF and actual[3, 18] == NEG_INF and actual[3, 9] == NEG_INF
    assert torch.isfinite(actual[4]).all()
    assert actual[5, EOS] == logits[5, EOS] and actual[5, 4] == NEG_INF
    assert torch.isfinite(actual[6]).tolist() == [t in (1, 3) for t in range(vocab_size)]


def test_penalties_match_reference() -> None:
    vocab_size = 24
    prompt, output = [1, 2, 3, 3, 20], [3, 4, 4, 4, 5, 21]
    rows = [
        make_row(SamplingParams(), prompt, output),
        make_row(SamplingParams(repetition_penalty=1.5), prompt, output),
        make_row(SamplingParams(repetition_penalty=0.7), prompt, output),
        make_row(SamplingParams(presence_penalty=1.2), prompt, output),
        make_row(SamplingParams(frequency_penalty=0.4), prompt, output),
        make_row(
            SamplingParams(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.5),
            prompt,
            output,
        ),
        make_row(SamplingParams(repetition_penalty=1.3), [7, 8], []),
    ]
    logits = random_logits(len(rows), vocab_size, seed=1)
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    assert not metadata.no_penalties
    actual = apply_penalties(logits.clone(), metadata)
    assert_same_logits(actual, [ref_penalties(logits[i].tolist(), row) for i, row in enumerate(rows)])
    assert torch.equal(actual[0], logits[0])


def test_top_k_top_p_match_reference() -> None:
    vocab_size = 40
    settings = [(0, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.6), (1, 1.0), (39, 0.3), (100, 0.95)]
    rows = [make_row(SamplingParams(top_k=k, top_p=p)) for k, p in settings]
    logits = random_logits(len(rows), vocab_size, seed=2)
    logits[0, 3] = NEG_INF  # a masked token stays masked
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    actual = apply_top_k_top_p(logits.clone(), metadata.top_k, metadata.max_top_k, metadata.top_p)
    assert_same_logits(actual, ref_top_k_top_p(logits, settings))
    kept = torch.isfinite(actual).sum(dim=-1).tolist()
    assert kept[1] == 5 and kept[5] == 1 and kept[0] == vocab_size - 1


def test_top_p_on_a_large_vocabulary_equals_the_full_sort() -> None:
    """The histogram-candidate path against the plain per-row reference: peaked rows (a nucleus of a
    few tokens), flat rows (thousands), rows rounded to bfloat16 (many exact ties at the boundary),
    top-k with top-p, and top-p off."""
    vocab_size = 5000
    g = torch.Generator().manual_seed(7)
    scales = [8.0, 4.0, 0.05, 3.0, 3.0, 6.0, 2.0]
    settings = [(0, 0.9), (0, 0.99), (0, 0.9), (0, 0.8), (50, 0.9), (0, 1.0), (1000, 0.5)]
    logits = torch.stack([torch.randn(vocab_size, generator=g) * scale for scale in scales])
    logits[3] = logits[3].bfloat16().float()  # ties everywhere
    logits[3, :40] = logits[3].max()  # a 40-way tie at the top
    rows = [make_row(SamplingParams(top_k=k, top_p=p)) for k, p in settings]
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    actual = apply_top_k_top_p(logits.clone(), metadata.top_k, metadata.max_top_k, metadata.top_p)
    assert_same_logits(actual, ref_top_k_top_p(logits, settings))
    kept = torch.isfinite(actual).sum(dim=-1).tolist()
    assert kept[0] < 256 < kept[2] and kept[5] == vocab_size and kept[4] <= 50
    # The 40-way tie at the top: the stable order keeps a prefix of it, lowest ids first.
    tied_kept = torch.isfinite(actual[3, :40]).tolist()
    assert tied_kept == sorted(tied_kept, reverse=True), tied_kept


@pytest.mark.parametrize("implementation", ["_apply_top_p", "_apply_top_p_torch"])
@pytest.mark.parametrize("bfloat16_ties", [False, True])
def test_top_p_candidates_equal_the_full_sort_on_random_rows(
    bfloat16_ties: bool, implementation: str
) -> None:
    """The C kernel (on a CPU with the library) and the torch histogram path (GPUs, no compiler) against
    the stable full sort that defines top-p."""
    from izh.engine import sampler
    from izh.engine.sampler import _apply_top_p_sorted

    _apply_top_p = getattr(sampler, implementation)

    g = torch.Generator().manual_seed(11)
    num_rows, vocab_size = 48, 3000
    scales = torch.logspace(-2, 1.2, num_rows).unsqueeze(1)  # from nearly flat to very peaked rows
    logits = torch.randn(num_rows, vocab_size, generator=g) * scales
    if bfloat16_ties:
        logits = logits.bfloat16().float()
    top_p = torch.rand(num_rows, generator=g) * 0.98 + 0.01
    top_p[::7] = 1.0  # top-p off in a mixed batch: those rows are left alone
    actual = _apply_top_p(logits.clone(), top_p)
    expected = torch.where((top_p < 1).unsqueeze(1), _apply_top_p_sorted(logits.clone(), top_p), logits)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    assert torch.equal(actual[torch.isfinite(actual)], logits[torch.isfinite(actual)])
    assert torch.equal(actual[::7], logits[::7])


def test_inverse_cdf_sampling_follows_the_distribution() -> None:
    vocab_size = 6
    probs = [0.5, 0.0, 0.25, 0.125, 0.125, 0.0]
    logits = torch.tensor([[math.log(p) if p > 0 else NEG_INF for p in probs]] * 4000)
    rows = [make_row(SamplingParams(temperature=1.0))] * 4000
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    sampler = Sampler(make_generator(1234, "cpu"))
    counts = Counter(sampler(logits.clone(), metadata).sampled_token_ids)
    assert counts[1] == counts[5] == 0  # zero-probability tokens are never drawn
    for token, p in enumerate(probs):
        if p > 0:
            # 4000 draws: the standard deviation of a frequency is at most 0.8%; allow 4 of them.
            assert abs(counts[token] / 4000 - p) < 0.032, (token, counts[token])


def test_top_k_only_keeps_boundary_ties() -> None:
    vocab_size = 10
    logits = torch.tensor([[0.0, 3.0, 2.0, 2.0, 1.0, 2.0, -1.0, 0.5, 0.1, 2.5]] * 3)
    rows = [make_row(SamplingParams(top_k=k)) for k in (2, 3, 0)]
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    assert metadata.top_p is None and metadata.max_top_k == 3
    actual = apply_top_k_top_p(logits.clone(), metadata.top_k, metadata.max_top_k, metadata.top_p)
    assert_same_logits(actual, [ref_top_k(logits[i].tolist(), k) for i, k in enumerate((2, 3, 0))])
    # k=3 lands on a three-way tie at 2.0: all three are kept.
    assert torch.isfinite(actual[1]).nonzero().flatten().tolist() == [1, 2, 3, 5, 9]


def test_min_p_matches_reference() -> None:
    vocab_size = 30
    min_ps = [0.0, 0.05, 0.3, 1.0]
    probs = random_logits(len(min_ps), vocab_size, seed=3).softmax(dim=-1)
    actual = apply_min_p(probs.clone(), torch.tensor(min_ps))
    expected = [ref_min_p(probs[i].tolist(), p) for i, p in enumerate(min_ps)]
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32))
    assert (actual[3] > 0).sum() == 1


# ---- whole-pipeline sampling ----


def test_all_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    vocab_size = 50
    logits = random_logits(6, vocab_size, seed=4)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    assert metadata.all_greedy and metadata.temperature is None
    output = Sampler()(logits.clone(), metadata)
    assert output.sampled_token_ids == [row.index(max(row)) for row in logits.tolist()]
    assert output.sampled_token_ids[2] == 7
    assert output.logprobs is None


def test_default_greedy_batch_builds_no_tensors() -> None:
    rows = [make_row(SamplingParams(temperature=0.0), prompt=[1, 2, 3], output=[4]) for _ in range(256)]
    metadata = SamplingMetadata.build(rows, 32000, "cpu")
    assert metadata.all_greedy and metadata.no_penalties and metadata.no_token_masks
    assert metadata.no_top_k and metadata.no_top_p and metadata.no_min_p
    assert metadata.temperature is None and metadata.greedy_mask is None
    assert metadata.prompt_mask is None and metadata.max_num_logprobs is None


def test_mixed_batch_greedy_rows_take_argmax_of_processed_logits() -> None:
    vocab_size = 16
    rows = [
        make_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[1, 2, 3], output=[4, 5]),
        make_row(SamplingParams(temperature=1.0, top_k=3)),
        make_row(SamplingParams(temperature=0.0, logit_bias={9: 50.0})),
        make_row(SamplingParams(temperature=0.5, seed=11)),
        make_row(SamplingParams(temperature=0.0, min_tokens=5, allowed_token_ids=[0, 6]), output=[6]),
    ]
    logits = random_logits(len(rows), vocab_size, seed=5)
    logits[0, 1:6] += 10.0  # the penalised, seen tokens lead before the penalty
    logits[4, EOS] += 10.0
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    assert not metadata.all_greedy and not metadata.all_random
    output = Sampler(torch.Generator().manual_seed(0))(logits.clone(), metadata)
    for i in (0, 2, 4):
        expected = ref_penalties(ref_masks(logits[i].tolist(), rows[i]), rows[i])
        assert output.sampled_token_ids[i] == expected.index(max(expected))
    assert output.sampled_token_ids[2] == 9 and output.sampled_token_ids[4] == 6
    assert output.sampled_token_ids[1] in logits[1].topk(3).indices.tolist()


def test_min_tokens_holds_back_eos_until_reached() -> None:
    vocab_size = 8
    logits = torch.zeros(4, vocab_size)
    logits[:, EOS] = 20.0
    logits[:, 5] = 10.0
    logits[:, 6] = 15.0
    rows = [
        make_row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]), output=[1]),
        make_row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]), output=[1, 1]),
        make_row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6], ignore_eos=True)),
        make_row(SamplingParams(temperature=0.0, min_tokens=2), eos=frozenset()),
    ]
    output = Sampler()(logits, SamplingMetadata.build(rows, vocab_size, "cpu"))
    assert output.sampled_token_ids == [5, EOS, EOS, EOS]


def sample_many(
    rows: list[SamplingRow], logits: torch.Tensor, copies: int, seed: int
) -> tuple[torch.Tensor, list[SamplingRow]]:
    """Each row repeated `copies` times in one batch; returns [len(rows), copies] samples."""
    batch = [row for row in rows for _ in range(copies)]
    metadata = SamplingMetadata.build(batch, logits.shape[1], "cpu")
    output = Sampler(torch.Generator().manual_seed(seed))(logits.repeat_interleave(copies, dim=0), metadata)
    return torch.tensor(output.sampled_token_ids).view(len(rows), copies), batch


def test_sampling_frequencies_match_reference_distribution() -> None:
    vocab_size, copies = 12, 20_000
    rows = [
        make_row(SamplingParams(temperature=1.0)),
        make_row(SamplingParams(temperature=0.6)),
        make_row(SamplingParams(temperature=1.5, top_k=4)),
        make_row(SamplingParams(temperature=0.8, top_p=0.7)),
        make_row(SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.1)),
        make_row(
            SamplingParams(
                temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={11: 1.0}
            ),
            prompt=[1, 2],
            output=[2, 3, 3],
        ),
        make_row(SamplingParams(temperature=0.0, frequency_penalty=0.3), output=[4]),
    ]
    logits = random_logits(len(rows), vocab_size, seed=6, scale=1.0)
    samples, _ = sample_many(rows, logits, copies, seed=123)
    for i, row in enumerate(rows):
        expected = ref_distribution(logits[i].tolist(), row)
        counts = torch.bincount(samples[i], minlength=vocab_size).tolist()
        for token_id, (count, prob) in enumerate(zip(counts, expected, strict=True)):
            if prob == 0.0:
                assert count == 0, f"row {i} sampled token {token_id}, which it must never sample"
                continue
            # Five standard deviations of a binomial frequency: a real mismatch is far outside it.
            bound = 5 * math.sqrt(prob * (1 - prob) / copies) + 1e-3
            assert abs(count / copies - prob) <= bound, (i, token_id, count / copies, prob)


def test_top_k_never_samples_outside_top_k() -> None:
    vocab_size, copies = 64, 4_000
    rows = [make_row(SamplingParams(temperature=5.0, top_k=k)) for k in (1, 3, 10)]
    logits = random_logits(len(rows), vocab_size, seed=7)
    samples, _ = sample_many(rows, logits, copies, seed=9)
    for i, top_k in enumerate((1, 3, 10)):
        allowed = set(logits[i].topk(top_k).indices.tolist())
        drawn = set(samples[i].tolist())
        assert drawn <= allowed
        assert len(drawn) == top_k  # a hot temperature reaches every allowed token


# ---- seeds ----


def run_steps(
    batch: list[SamplingRow], target: int, logits_per_step: list[torch.Tensor], seed: int
) -> list[int]:
    """Sample the batch for several steps; the target row sees logits_per_step, others random logits."""
    sampler = Sampler(torch.Generator().manual_seed(seed))
    tokens = []
    for step, target_logits in enumerate(logits_per_step):
        logits = random_logits(len(batch), target_logits.numel(), seed=1000 * seed + step)
        logits[target] = target_logits
        output = sampler(logits, SamplingMetadata.build(batch, target_logits.numel(), "cpu"))
        for row, token_id in zip(batch, output.sampled_token_ids, strict=True):
            row.output_token_ids.append(token_id)
        tokens.append(output.sampled_token_ids[target])
    return tokens


def test_seeded_row_is_reproducible_across_batches_and_positions() -> None:
    vocab_size = 64
    steps = [random_logits(1, vocab_size, seed=100 + s, scale=0.5)[0] for s in range(8)]

    def seeded(seed: int = 42) -> SamplingRow:
        return make_row(SamplingParams(temperature=1.0, top_p=0.95, seed=seed, presence_penalty=0.2))

    alone = run_steps([seeded()], 0, steps, seed=1)
    crowded = [
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=1.0)),
        make_row(SamplingParams(temperature=0.7, seed=99)),
        seeded(),
        make_row(SamplingParams(temperature=1.3, top_k=5, min_p=0.1)),
    ]
    in_crowd = run_steps(crowded, 3, steps, seed=2)
    first_of_two = run_steps([seeded(), make_row(SamplingParams())], 0, steps, seed=3)
    assert alone == in_crowd == first_of_two
    assert run_steps([seeded(seed=43)], 0, steps, seed=1) != alone


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    vocab_size = 64
    rows = [make_row(SamplingParams(temperature=1.0)) for _ in range(8)]
    logits = random_logits(len(rows), vocab_size, seed=8, scale=0.1)
    metadata = SamplingMetadata.build(rows, vocab_size, "cpu")
    first = Sampler(torch.Generator().manual_seed(5))(logits.clone(), metadata).sampled_token_ids
    again = Sampler(torch.Generator().manual_seed(5))(logits.clone(), metadata).sampled_token_ids
    other = Sampler(torch.Generator().manual_seed(6))(logits.clone(), metadata).sampled_token_ids
    assert first == again and first != other


def test_seeded_row_without_generator_is_rejected() -> None:
    row = SamplingRow(SamplingParams(seed=1), [], [], frozenset(), None)
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.build([row], 10, "cpu")


def test_logits_shape_must_match_metadata() -> None:
    metadata = SamplingMetadata.build([make_row(SamplingParams())], 10, "cpu")
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(2, 10), metadata)


# ---- logprobs ----


def check_logprobs(record: TokenLogprobs, raw_logits: torch.Tensor, token_id: int, num_top: int) -> None:
    reference = torch.log_softmax(raw_logits, dim=-1)
    assert record.token_id == token_id
    assert record.logprob == pytest.approx(reference[token_id].item(), abs=1e-5)
    assert record.rank == 1 + int((reference > reference[token_id]).sum())
    order = sorted(range(raw_logits.numel()), key=lambda t: -reference[t].item())[:num_top]
    assert [t for t, _ in record.top] == order
    assert [v for _, v in record.top] == pytest.approx([reference[t].item() for t in order], abs=1e-5)


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    vocab_size = 32
    rows = [
        make_row(
            SamplingParams(temperature=0.8, logprobs=3, presence_penalty=1.0, logit_bias={4: 5.0}), output=[1]
        ),
        make_row(SamplingParams(temperature=1.0)),
        make_row(SamplingParams(temperature=0.0, logprobs=0)),
        make_row(SamplingParams(temperature=2.0, logprobs=5, seed=3)),
        make_row(SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[17])),
    ]
    logits = random_logits(len(rows), vocab_size, seed=10)
    output = Sampler(torch.Generator().manual_seed(0))(
        logits.clone(), SamplingMetadata.build(rows, vocab_size, "cpu")
    )
    assert output.logprobs is not None and output.logprobs[1] is None
    for i, num_top in ((0, 3), (2, 0), (3, 5), (4, 2)):
        record = output.logprobs[i]
        assert record is not None
        check_logprobs(record, logits[i], output.sampled_token_ids[i], num_top)
    assert output.sampled_token_ids[4] == 17 and output.logprobs[4].rank > 1  # type: ignore[union-attr]
    assert output.logprobs[2].rank == 1  # type: ignore[union-attr]


def test_rank_counts_only_strictly_greater() -> None:
    logits = torch.tensor([[1.0, 4.0, 4.0, 0.0], [1.0, 4.0, 4.0, 0.0]])
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=1)),
        make_row(SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[2])),
    ]
    output = Sampler()(logits.clone(), SamplingMetadata.build(rows, 4, "cpu"))
    assert output.sampled_token_ids == [1, 2]
    assert output.logprobs is not None
    assert [record.rank for record in output.logprobs if record is not None] == [1, 1]


def test_prompt_logprobs_match_log_softmax() -> None:
    vocab_size = 40
    logits = random_logits(5, vocab_size, seed=11)
    next_token_ids = [3, 39, 0, 17, 3]
    for num_top in (0, 4):
        records = compute_prompt_logprobs(logits, next_token_ids, num_top)
        assert len(records) == 5
        for i, record in enumerate(records):
            check_logprobs(record, logits[i], next_token_ids[i], num_top)
    assert Sampler.compute_prompt_logprobs(logits, next_token_ids, 2) == compute_prompt_logprobs(
        logits, next_token_ids, 2
    )


def test_token_logprobs_round_trip_msgpack() -> None:
    record = compute_prompt_logprobs(random_logits(1, 10, seed=12), [4], 3)[0]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=TokenLogprobs)
    assert decoded == record
