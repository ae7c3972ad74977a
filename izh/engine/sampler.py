"""The batched sampler: logits of the rows that sample this step → next token ids (+ logprobs).

Order, as in vLLM: allowed_token_ids / bad_words / logit_bias / min_tokens masks → penalties → greedy
argmax → temperature → top-k → top-p → min-p → sample. Logprobs are always those of the raw model
logits (vLLM's default "raw_logprobs"), so they describe the model, not the sampling settings: a
token allowed_token_ids or bad_words masks keeps its logprob among the top ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from izh.engine_messages import TokenLogprobs

# TokenLogprobs is the wire record (izh.engine_messages); the sampler produces it directly.
from izh.kernels import cpu as cpu_ops
from izh.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "TokenIndex",
    "TokenLogprobs",
    "apply_min_p",
    "apply_penalties",
    "apply_token_masks",
    "apply_top_k_top_p",
    "bad_word_endings",
    "compute_prompt_logprobs",
    "make_generator",
]

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about one row (one request) this step.

    `generator` is the request's own generator when params.seed is set: created once with
    `make_generator` and kept by the caller across steps, so its stream continues where it left off.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row; `logprobs` is None when no row asked, else None for rows that didn't."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with a request's seed (any int in [-2**63, 2**64 - 1])."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class TokenIndex:
    """Sparse (row, token id) pairs, optionally with one value each."""

    row_ids: torch.Tensor  # [num_pairs] int64
    token_ids: torch.Tensor  # [num_pairs] int64
    values: torch.Tensor | None = None  # [num_pairs] float32


@dataclass
class SamplingMetadata:
    """The batch's sampling settings as tensors; a feature no row uses is None and costs nothing.

    Rows that don't use a feature get its neutral value (temperature 1 on greedy rows, top_k =
    vocab_size, top_p 1, min_p 0, penalties 1/0/0) so one batched op serves every row.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None = None  # [num_rows] bool; only for mixed batches
    temperature: torch.Tensor | None = None  # [num_rows] float32; None when all greedy
    top_k: torch.Tensor | None = None  # [num_rows] int64, vocab_size where off
    max_top_k: int = 0
    top_p: torch.Tensor | None = None  # [num_rows] float32
    min_p: torch.Tensor | None = None  # [num_rows] float32
    # Row index → that seeded random row's own generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    presence_penalties: torch.Tensor | None = None  # [num_rows] float32
    frequency_penalties: torch.Tensor | None = None  # [num_rows] float32
    repetition_penalties: torch.Tensor | None = None  # [num_rows] float32
    output_token_counts: torch.Tensor | None = None  # [num_rows, vocab_size] float32
    prompt_mask: torch.Tensor | None = None  # [num_rows, vocab_size] bool
    allowed_rows: torch.Tensor | None = None  # [num_allowed_rows] int64
    allowed_token_ids: TokenIndex | None = None
    bad_words_banned: TokenIndex | None = None
    logit_bias: TokenIndex | None = None
    min_tokens_banned: TokenIndex | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None  # None when no row asks for logprobs

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_token_masks(self) -> bool:
        return (
            self.allowed_rows is None
            and self.bad_words_banned is None
            and self.logit_bias is None
            and self.min_tokens_banned is None
        )

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingMetadata:
        """Batch `rows` (in logits row order). Allocates [rows, vocab] only for rows with penalties."""
        greedy_flags = [row.params.is_greedy for row in rows]
        all_greedy = all(greedy_flags)
        all_random = not any(greedy_flags)
        metadata = cls(
            num_rows=len(rows), vocab_size=vocab_size, all_greedy=all_greedy, all_random=all_random
        )
        if not all_greedy:
            _fill_random_sampling(metadata, rows, greedy_flags, device)
        _fill_penalties(metadata, rows, device)
        _fill_token_masks(metadata, rows, device)
        metadata.num_logprobs = [row.params.logprobs for row in rows]
        requested = [n for n in metadata.num_logprobs if n is not None]
        metadata.max_num_logprobs = max(requested) if requested else None
        return metadata


def _on_device(values: list[Any], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without its stream sync on CUDA (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without a stream sync (the model runner's inputs and the sampler's
    metadata). On CUDA a plain copy waits for the stream, that is for the forward and logits queued
    before it; a non-blocking copy from pageable memory is staged by the driver before it returns, so
    `host` may be freed or reused at once and the host builds the next tensors meanwhile."""
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)


def _fill_random_sampling(
    metadata: SamplingMetadata, rows: list[SamplingRow], greedy_flags: list[bool], device: torch.device | str
) -> None:
    """Temperature, top-k/p, min-p and generators; greedy rows get neutral values."""
    vocab_size = metadata.vocab_size
    temperatures: list[float] = []
    top_ks: list[int] = []
    top_ps: list[float] = []
    min_ps: list[float] = []
    for index, (row, greedy) in enumerate(zip(rows, greedy_flags, strict=True)):
        params = row.params
        if greedy:
            temperatures.append(1.0)
            top_ks.append(vocab_size)
            top_ps.append(1.0)
            min_ps.append(0.0)
            continue
        temperatures.append(params.temperature)
        top_k = params.top_k
        top_ks.append(top_k if 0 < top_k < vocab_size else vocab_size)
        top_ps.append(params.top_p)
        min_ps.append(params.min_p)
        if params.seed is not None:
            if row.generator is None:
                raise ValueError(f"row {index} has seed {params.seed} but no generator")
            metadata.generators[index] = row.generator
    metadata.temperature = _on_device(temperatures, torch.float32, device)
    if not metadata.all_random:
        metadata.greedy_mask = _on_device(greedy_flags, torch.bool, device)
    enabled_top_ks = [k for k in top_ks if k < vocab_size]
    if enabled_top_ks:
        metadata.top_k = _on_device(top_ks, torch.int64, device)
        metadata.max_top_k = max(enabled_top_ks)
    if any(p < 1.0 for p in top_ps):
        metadata.top_p = _on_device(top_ps, torch.float32, device)
    if any(p > 0.0 for p in min_ps):
        metadata.min_p = _on_device(min_ps, torch.float32, device)


def _fill_penalties(metadata: SamplingMetadata, rows: list[SamplingRow], device: torch.device | str) -> None:
    """Penalty vectors, output token counts and the prompt mask, only when some row has a penalty.

    vLLM semantics: presence and frequency count output tokens only; repetition covers prompt and
    output tokens. Only penalised rows' tokens are scattered: the rest have neutral penalties anyway.
    """
    presence = [row.params.presence_penalty for row in rows]
    frequency = [row.params.frequency_penalty for row in rows]
    repetition = [row.params.repetition_penalty for row in rows]
    has_presence = any(p != 0.0 for p in presence)
    has_frequency = any(f != 0.0 for f in frequency)
    has_repetition = any(r != 1.0 for r in repetition)
    if not (has_presence or has_frequency or has_repetition):
        return
    shape = (metadata.num_rows, metadata.vocab_size)
    penalised = [
        index
        for index in range(len(rows))
        if presence[index] != 0.0 or frequency[index] != 0.0 or repetition[index] != 1.0
    ]
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    flat = _flat_indices(
        penalised, [rows[i].output_token_ids for i in penalised], metadata.vocab_size, device
    )
    counts.view(-1).index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=device))
    metadata.output_token_counts = counts
    if has_presence:
        metadata.presence_penalties = _on_device(presence, torch.float32, device)
    if has_frequency:
        metadata.frequency_penalties = _on_device(frequency, torch.float32, device)
    if has_repetition:
        metadata.repetition_penalties = _on_device(repetition, torch.float32, device)
        repeated = [i for i in penalised if repetition[i] != 1.0]
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        flat = _flat_indices(
            repeated, [rows[i].prompt_token_ids for i in repeated], metadata.vocab_size, device
        )
        prompt_mask.view(-1)[flat] = True
        metadata.prompt_mask = prompt_mask


def _fill_token_masks(
    metadata: SamplingMetadata, rows: list[SamplingRow], device: torch.device | str
) -> None:
    """allowed_token_ids, bad words, logit_bias and min_tokens as sparse (row, token) pairs."""
    allowed = [
        (i, row.params.allowed_token_ids) for i, row in enumerate(rows) if row.params.allowed_token_ids
    ]
    if allowed:
        metadata.allowed_rows = _on_device([i for i, _ in allowed], torch.int64, device)
        metadata.allowed_token_ids = _token_index(
            [i for i, _ in allowed], [ids for _, ids in allowed], device
        )
    banned_words = [
        (i, ids) for i, row in enumerate(rows) if (ids := bad_word_endings(row.params, row.output_token_ids))
    ]
    if banned_words:
        metadata.bad_words_banned = _token_index(
            [i for i, _ in banned_words], [ids for _, ids in banned_words], device
        )
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        metadata.logit_bias = _token_index(
            [i for i, _ in biased],
            [list(bias.keys()) for _, bias in biased],
            device,
            values=list(chain.from_iterable(bias.values() for _, bias in biased)),
        )
    banned_rows: list[int] = []
    banned_ids: list[list[int]] = []
    for index, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        # Like vLLM, every token that would stop the request is banned until min_tokens; with
        # ignore_eos the EOS ids are not stops, so they stay allowed.
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= row.eos_token_ids
        if stops:
            banned_rows.append(index)
            banned_ids.append(sorted(stops))
    if banned_rows:
        metadata.min_tokens_banned = _token_index(banned_rows, banned_ids, device)


def bad_word_endings(params: SamplingParams, output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete one of the request's bad words after `output_token_ids`: the
    last token of each sequence whose other tokens end the output (of a one-token word, always).

    Only the output counts, as in vLLM: a word begun in the prompt is not the output's.
    """
    endings: set[int] = set()
    num_output = len(output_token_ids)
    for sequence in params.bad_words_token_ids:
        prefix_length = len(sequence) - 1
        if prefix_length > num_output:
            continue
        if prefix_length == 0 or output_token_ids[num_output - prefix_length :] == sequence[:-1]:
            endings.add(sequence[-1])
    return sorted(endings)


def _token_index(
    row_ids: list[int],
    token_ids_per_row: list[list[int]],
    device: torch.device | str,
    values: list[float] | None = None,
) -> TokenIndex:
    lengths = torch.tensor([len(ids) for ids in token_ids_per_row], dtype=torch.int64)
    return TokenIndex(
        row_ids=to_device(torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.int64), lengths), device),
        token_ids=_on_device(list(chain.from_iterable(token_ids_per_row)), torch.int64, device),
        values=None if values is None else _on_device(values, torch.float32, device),
    )


def _flat_indices(
    row_ids: list[int], token_ids_per_row: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """Indices into a flattened [num_rows, vocab_size] tensor for each (row, token) pair."""
    index = _token_index(row_ids, token_ids_per_row, device)
    return index.row_ids * vocab_size + index.token_ids


class Sampler:
    """Samples one token per row from float32 logits, batched across rows.

    Unseeded random rows draw their noise from `generator` (torch's default generator when None);
    seeded rows from their own, so a seeded request's tokens do not depend on the rest of the batch.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` [num_rows, vocab_size]; the sampler may modify `logits` in place."""
        if logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != ({metadata.num_rows}, {metadata.vocab_size})"
            )
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab_size]
        logits = apply_token_masks(logits, metadata)
        logits = apply_penalties(logits, metadata)
        sampled = self._sample(logits, metadata)  # [num_rows] int64
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _row_logprobs(raw_logprobs, sampled, metadata)
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)

    def distributions(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What `__call__` would sample from, without sampling (speculative verification): the raw
        logprobs (None when no row asks), the greedy rows' tokens (None when every row samples) and the
        random rows' probabilities [num_rows, vocab] after every mask, penalty, temperature, top-k, top-p
        and min-p (unnormalized rows; None when every row is greedy). May modify `logits` in place."""
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_token_masks(logits, metadata)
        logits = apply_penalties(logits, metadata)
        greedy = None if metadata.all_random else cpu_ops.argmax_rows(logits)
        if metadata.all_greedy:
            return raw_logprobs, greedy, None
        assert metadata.temperature is not None
        logits = logits.div_(metadata.temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        if metadata.min_p is not None:
            probs = apply_min_p(probs, metadata.min_p)
        return raw_logprobs, greedy, probs

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None
        if not metadata.all_random:
            # The first maximum: ties go to the lowest token id (max(dim)'s rule, which the C kernel
            # follows: 0.2 ms for 32 x 49k float32 logits on 2 cores, torch.max 0.5, 1.2 in a decode step).
            greedy = cpu_ops.argmax_rows(logits)
            if metadata.all_greedy:
                return greedy
        assert metadata.temperature is not None
        logits = logits.div_(metadata.temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
        uniform = self._uniforms(logits.shape[0], metadata.generators, logits.device)
        if metadata.min_p is None:
            # softmax + inverse CDF in one C pass on a CPU (izh.kernels.cpu.sample_rows_ref defines it).
            sampled = cpu_ops.sample_rows(logits, uniform)
        else:
            probs = apply_min_p(logits.softmax(dim=-1), metadata.min_p)
            sampled = cpu_ops.inverse_cdf_ref(probs, uniform)
        if greedy is None:
            return sampled
        assert metadata.greedy_mask is not None
        return torch.where(metadata.greedy_mask, greedy, sampled)

    def _uniforms(
        self, num_rows: int, generators: dict[int, torch.Generator], device: torch.device
    ) -> torch.Tensor:
        """One uniform u in [0, 1) per row (float64): from the row's own generator for seeded requests,
        else from the engine's. The token is then the first whose cumulative probability exceeds u times
        the row's total (rows need not sum to 1: min_p zeroes some; a zero-probability token adds nothing
        to the cumulative sum, so it is never picked).

        One random number per row, not one per vocabulary entry (the exponential race vLLM uses on GPU
        draws 49k per row: ~30 ms a step at batch 32 on a CPU, against ~1 ms for this).
        """
        uniform = torch.empty(num_rows, dtype=torch.float64, device=device)
        if len(generators) < num_rows:
            uniform.uniform_(generator=self.generator)
        for row, generator in generators.items():
            uniform[row] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
        return uniform

    @staticmethod
    def compute_prompt_logprobs(
        logits: torch.Tensor, next_token_ids: list[int], num_top: int
    ) -> list[TokenLogprobs]:
        """The module's `compute_prompt_logprobs`, for callers that hold a Sampler."""
        return compute_prompt_logprobs(logits, next_token_ids, num_top)


def apply_token_masks(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids (everything else -inf), then bad words, logit_bias and min_tokens bans, in place."""
    if metadata.allowed_rows is not None:
        allowed = metadata.allowed_token_ids
        assert allowed is not None
        kept = logits[allowed.row_ids, allowed.token_ids]
        logits.index_fill_(0, metadata.allowed_rows, _NEG_INF)
        logits[allowed.row_ids, allowed.token_ids] = kept
    if metadata.bad_words_banned is not None:
        banned = metadata.bad_words_banned
        logits[banned.row_ids, banned.token_ids] = _NEG_INF
    if metadata.logit_bias is not None:
        bias = metadata.logit_bias
        assert bias.values is not None
        logits.index_put_((bias.row_ids, bias.token_ids), bias.values, accumulate=True)
    if metadata.min_tokens_banned is not None:
        banned = metadata.min_tokens_banned
        logits[banned.row_ids, banned.token_ids] = _NEG_INF
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens), then frequency and presence (output tokens only)."""
    counts = metadata.output_token_counts
    if counts is None:
        return logits
    if metadata.repetition_penalties is not None:
        seen = counts > 0
        if metadata.prompt_mask is not None:
            seen |= metadata.prompt_mask
        scale = torch.where(seen, metadata.repetition_penalties.unsqueeze(1), 1.0)
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if metadata.frequency_penalties is not None:
        logits -= metadata.frequency_penalties.unsqueeze(1) * counts
    if metadata.presence_penalties is not None:
        logits -= metadata.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf all but each row's top-k logits, then all but its top-p nucleus.

    Top-k keeps every token whose logit is >= the k-th largest, so ties at the boundary are all kept
    (as in HF and vLLM). Top-p keeps the smallest prefix of tokens, by descending probability after
    top-k, whose cumulative probability reaches top_p; the top token is always kept. Ties in top-p are
    ordered by token id (a stable sort).
    """
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k, max_top_k)
    if top_k is not None:
        logits = _apply_top_k_only(logits, top_k, max_top_k)
    return _apply_top_p(logits, top_p)


_TOP_P_BUCKETS = 1024
_TOP_P_BUCKET_WIDTH = 0.05
_TOP_P_MARGIN = 1e-3


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p: one C pass per row on a CPU (`cpu_ops.top_p_mask_`: 4 ms for 32 peaked rows of 49k, where
    the torch path takes 26), else torch."""
    masked = cpu_ops.top_p_mask_(logits, top_p)
    return masked if masked is not None else _apply_top_p_torch(logits, top_p)


def _apply_top_p_torch(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by sorting only the tokens that can be in the nucleus, not the whole vocabulary.

    A full stable sort of 49k logits a row costs ~60 ms a step at batch 32 on a CPU. Instead, a histogram
    of each row's logits (buckets of 0.05 below its maximum, weighted by probability) finds a set of top
    tokens that holds at least top_p of the mass, with a small margin for rounding: the nucleus is then
    among those tokens, and every other token sits after them in the sorted order with at least top_p
    of mass before it, so it is masked anyway. The largest count over the rows is taken with `topk`,
    re-sorted by (logit descending, token id) as the stable full sort orders them, and cut where the
    cumulative mass reaches top_p. A row that keeps every candidate (the margin did not hold) goes
    through the full sort.
    """
    vocab = logits.shape[1]
    active = top_p < 1.0  # rows with top_p 1 (top-p off in a mixed batch) keep every token
    if not bool(active.any()):
        return logits
    # softmax's own numbers over the (top-k masked) row: max-shifted exponentials and their sum.
    row_max = logits.amax(dim=-1, keepdim=True)
    exps = (logits - row_max).exp_()
    denominator = exps.sum(dim=-1, keepdim=True)
    needed = (top_p.unsqueeze(1) + _TOP_P_MARGIN).clamp(max=1.0) * denominator
    # One pass of a histogram: bucket j holds the tokens whose logit is j to j+1 bucket widths below
    # the row's maximum (the last bucket everything further down; masked tokens add no mass).
    buckets = ((row_max - logits) / _TOP_P_BUCKET_WIDTH).clamp_(max=_TOP_P_BUCKETS - 1).long()
    mass = torch.zeros(logits.shape[0], _TOP_P_BUCKETS, dtype=exps.dtype, device=exps.device)
    mass.scatter_add_(1, buckets, exps)
    # The first bucket at which the mass from the top reaches `needed`: its tokens and all above it.
    crossing = (mass.cumsum(dim=-1) < needed).sum(dim=-1, keepdim=True)
    k = int((buckets <= crossing).sum(dim=-1)[active].max())  # rows with top-p off need no candidates
    if k >= vocab:
        return torch.where(active.unsqueeze(1), _apply_top_p_sorted(logits, top_p), logits)
    values, ids = logits.topk(k, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    probs = (values - row_max).exp_().div_(denominator)
    keep = (probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(1)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, ids, values.masked_fill_(~keep, _NEG_INF))
    unsure = active & keep[:, -1]
    if bool(unsure.any()):
        out[unsure] = _apply_top_p_sorted(logits[unsure], top_p[unsure])
    return torch.where(active.unsqueeze(1), out, logits)


def _apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    # Probability mass strictly before each token: 0 for the top token, so it always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # topk(max_top_k) instead of a full sort: the k-th value is all top-k needs.
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k]
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_((top_k > max_top_k).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero, in place, every probability below min_p times its row's highest probability."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of each prompt position's next token under `logits` [n, vocab] (raw), plus the top num_top."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(next_token_ids)} next tokens")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = torch.tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    return _token_logprobs(logprobs, token_ids, num_top)


def _row_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, metadata: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Logprobs for the rows that asked, computed once at the batch's largest N and trimmed per row."""
    asking = [i for i, n in enumerate(metadata.num_logprobs) if n is not None]
    assert metadata.max_num_logprobs is not None
    if len(asking) < metadata.num_rows:
        index = torch.tensor(asking, dtype=torch.int64, device=raw_logprobs.device)
        raw_logprobs, sampled = raw_logprobs[index], sampled[index]
    records = _token_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
    result: list[TokenLogprobs | None] = [None] * metadata.num_rows
    for row, record in zip(asking, records, strict=True):
        num_top = metadata.num_logprobs[row]
        assert num_top is not None
        if len(record.top) > num_top:
            record = TokenLogprobs(record.token_id, record.logprob, record.rank, record.top[:num_top])
        result[row] = record
    return result


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """TokenLogprobs of token_ids[i] under the log-probabilities logprobs[i] [m, vocab], each with its
    row's top num_top (speculative verification's accepted tokens)."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)
    return _token_logprobs(logprobs[: len(token_ids)], ids, num_top)


def _token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """TokenLogprobs for token_ids[i] under logprobs[i] [m, vocab], with each row's top num_top."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [m, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[1])
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        top_lists = list(zip(top_ids.tolist(), top_values.tolist(), strict=True))
    else:
        top_lists = [([], [])] * logprobs.shape[0]
    return [
        TokenLogprobs(token_id, logprob, rank, list(zip(ids, values, strict=True)))
        for token_id, logprob, rank, (ids, values) in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_lists, strict=True
        )
    ]
