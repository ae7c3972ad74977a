"""Speculative decoding: n-gram proposals and their verification by one batched step of the target.

A proposer guesses up to k tokens that follow a request's known tokens; the scheduler schedules the last
known token and the k drafts in one step (1 + k KV slots); the model runner computes the target's logits
at those k + 1 positions, each row as a single-token decode would compute it (izh.engine.model_runner), and
`verify` keeps the longest prefix of drafts the target agrees with, plus one token of its own:

- greedy: draft i is accepted while it equals the target's argmax at its position; the first argmax that
  differs (or the one after the last draft) is the target's own token. The tokens are exactly those of
  decoding without drafts, as long as each row's logits are those a decode would compute.
- temperature > 0: rejection sampling (Leviathan et al., Chen et al.). A proposer here gives one token per
  position (a point mass q), so draft x is accepted with probability p(x) (min(1, p(x) / q(x)) with
  q(x) = 1), and a rejected draft is replaced by a sample of the residual max(p - q, 0) normalized: p with
  x taken out. Every emitted token is then distributed exactly as p, the distribution the sampler itself
  would sample from (masks, penalties, temperature, top-k, top-p, min-p applied to the same row). The
  draws come from the request's own generator when it has a seed, in a fixed order, so a seeded request
  is reproducible.

With a draft model (izh.engine.draft_model) the drafts are sampled from the draft's distribution q, and
draft x is accepted with probability min(1, p(x) / q(x)), a rejected one replaced by a sample of
max(p - q, 0) normalized: again exactly p. A greedy request's draft is the draft's argmax, verified as any.

The n-gram proposer (prompt lookup, as vLLM's `ngram` method): the longest suffix of the known tokens,
between prompt_lookup_max and prompt_lookup_min tokens long, that occurred earlier in the prompt or the
output; the tokens that followed its latest earlier occurrence are the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from izh.config import SPEC_METHODS, SpeculativeConfig
from izh.kernels import cpu as cpu_ops


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Prompt lookup over prompt + output (stateless: the tokens are searched anew each step)."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens to follow `token_ids`; [] when no suffix
        of prompt_lookup_min or more tokens occurred before."""
        k = min(self.num_speculative_tokens, max_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            suffix = tokens[num_tokens - n :]
            # Candidate starts of an earlier occurrence: where its first token matches (cheap), then the rest.
            starts = np.flatnonzero(tokens[: num_tokens - n] == suffix[0])
            for offset in range(1, n):
                if not len(starts):
                    break
                starts = starts[tokens[starts + offset] == suffix[offset]]
            if len(starts):
                follow = int(starts[-1]) + n  # the latest occurrence: the nearest context
                return token_ids[follow : follow + k]
        return []


@dataclass(slots=True)
class VerifyResult:
    """One request's verified step: the tokens to append (accepted drafts, then the target's own)."""

    token_ids: list[int]
    num_accepted: int


def verify_greedy(argmax: list[int], draft: list[int]) -> VerifyResult:
    """`argmax[i]` is the target's token at draft position i (len(draft) + 1 rows)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == argmax[accepted]:
        accepted += 1
    return VerifyResult([*draft[:accepted], argmax[accepted]], accepted)


def verify_random(
    probs: torch.Tensor,
    draft: list[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Rejection sampling of drafts against the target's probabilities `probs` [k + 1, vocab] (float32,
    rows need not sum to 1: each is normalized by its own total). Draws from `generator` (the engine's
    when None): one uniform per draft tested, then one for the token the target samples.

    `draft_probs` [>= k, vocab] (rows summing to 1) is the distribution q each draft token was sampled
    from (a draft model's); None: point masses (an n-gram draft). Draft x is accepted with probability
    min(1, p(x) / q(x)); a rejected one is replaced by a sample of max(p - q, 0) normalized."""
    if draft_probs is not None:
        return _verify_against(probs, draft, generator, draft_probs)
    totals = probs.sum(dim=-1, dtype=torch.float64)
    accepted = 0
    for position, token in enumerate(draft):
        p = float(probs[position, token]) / float(totals[position])
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if u >= p:
            # Rejected: sample the residual, p without the draft token.
            residual = probs[position : position + 1].clone()
            residual[0, token] = 0.0
            if float(residual.sum()) <= 0.0:  # p held only the draft token: u >= 1 cannot happen
                return VerifyResult([*draft[:position], token], position)
            return VerifyResult([*draft[:position], _draw(residual, generator)], position)
        accepted += 1
    return VerifyResult([*draft, _draw(probs[accepted : accepted + 1], generator)], accepted)


def _verify_against(
    probs: torch.Tensor, draft: list[int], generator: torch.Generator | None, draft_probs: torch.Tensor
) -> VerifyResult:
    """verify_random with a draft distribution q: accept x when u * q(x) < p(x) (u uniform in [0, 1))."""
    for position, token in enumerate(draft):
        p_row = probs[position].double()
        p_row = p_row / p_row.sum()
        q_row = draft_probs[position].double()
        q_row = q_row / q_row.sum()  # the very q sample_draft drew from (float32, normalized once more)
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if u * float(q_row[token]) >= float(p_row[token]):
            residual = (p_row - q_row).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # rounding: p <= q everywhere, so p itself is the residual
                residual = p_row
            return VerifyResult([*draft[:position], _draw(residual.unsqueeze(0), generator)], position)
    accepted = len(draft)
    return VerifyResult([*draft, _draw(probs[accepted : accepted + 1], generator)], accepted)


def sample_draft(probs: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """A draft model's token from its unnormalized probabilities `probs` [vocab], and the row it was drawn
    from (float32, normalized: the q that verification weighs it by)."""
    q = probs.double()
    q = (q / q.sum()).float()
    return _draw(q.unsqueeze(0), generator), q


def _draw(row: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the unnormalized probabilities `row` [1, vocab] by the inverse CDF."""
    uniform = torch.rand(1, dtype=torch.float64, generator=generator)
    return int(cpu_ops.inverse_cdf_ref(row, uniform)[0])


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    """The proposer `config` names (None: speculative decoding is off)."""
    if config is None:
        return None
    if config.method == "draft_model":
        raise ValueError("a draft model proposes through izh.engine.draft_model.DraftModelProposer")
    if config.method != "ngram":
        raise ValueError(
            f"unknown speculative method {config.method!r}; supported: {', '.join(SPEC_METHODS)}"
        )
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
