"""Speculative decoding's `draft_model` method: a smaller model of the same tokenizer proposes each
speculating request's k drafts by k small decode steps, batched across the requests.

The draft runs in the engine core, in a second ModelRunner (the same loader, packing and C kernels as the
target), with a KV cache of its own that shares the target's block tables (as vLLM's draft layers do): its
tensors have the target's block count and block size, and a request's draft KV sits at the same slots as
its target KV. The scheduler's blocks therefore serve both models: a block freed (a finished or preempted
request, rejected drafts trimmed) is freed for the draft too, and the KV budget is split by the two
models' bytes per block (ModelRunner's `extra_kv_bytes_per_block`).

Consistency with the request's tokens. `_DraftState.num_valid` counts the leading positions whose draft KV
was computed from the request's own tokens; the draft tokens it fed after them (`fed`) are checked against
the tokens the request has once verification is done: those it kept are valid KV too (the same token at
the same position after the same prefix), the rest are overwritten. A round, for the requests at a decode:

1. catch up: the tokens from `num_valid` to the last known one (the prompt, the first time; after a
   verification, the target's own token, and the last draft too when all k were accepted). A long catch-up
   runs as prefill chunks of at most the step's token budget; its last tokens run as single-token decodes,
   so that the round's first logits are those of a decode step of the last known token;
2. k - 1 more single-token decode steps, each feeding the previous draft.

A draft is the argmax of the draft's logits for a greedy request (after the request's masks and
penalties), else a sample of its distribution q under the request's sampling parameters, drawn from the
request's generator; q is kept for verification (izh.engine.spec_decode.verify_random: accept with
min(1, p / q), resample max(p - q, 0) on rejection), so the output distribution stays the target's.

Prefix caching. A block's target KV may be cached by a request whose draft never computed it (drafting
paused, opted out, finished first), so a prefix hit does not vouch for the draft's KV. `_block_marks` does:
block id -> the chain hash of the tokens the draft computed in all of that block's slots, from a valid
prefix. A request new to the draft (or preempted since its last round) starts after its leading blocks
whose mark is their hash (the same tokens after the same prefix: the same draft KV), else from 0. A block
the draft writes unverified drafts into loses its mark (those slots may end up holding another token).
LoRA adapters apply to the target only (the draft proposes as the base model; verification keeps the
adapter's tokens exact).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from izh.config import EngineConfig, SpeculativeConfig, default_batched_tokens
from izh.engine.model_runner import ModelRunner
from izh.engine.request import Request
from izh.engine.sampler import SamplingMetadata, SamplingRow, to_device
from izh.engine.spec_decode import sample_draft
from izh.errors import IzhError, ModelLoadError
from izh.kernels.kv_cache_dtype import kv_cache_format
from izh.model.attention import AttentionMetadata
from izh.model.loader import load_model_config
from izh.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

_DECODE_TAIL = 4
"""A catch-up's last tokens run as single-token decode rows (more run as prefill chunks first)."""
_CATCH_UP_PER_TOKEN_LEFT = 4
"""A request drafts only while its catch-up is at most this many tokens per output token it may still
produce: a draft prefill of a long context pays off over many drafted steps, not over a few (the tail of a
big batch, whose drafting paused while it ran, would otherwise prefill every context at once)."""


@dataclass(slots=True)
class _DraftState:
    """What the draft's KV holds for one request."""

    num_preemptions: int
    """The request's count when this state was made: a preemption since makes it stale."""
    num_valid: int = 0
    """Leading positions whose draft KV was computed from the request's own tokens."""
    fed: list[int] = field(default_factory=list)
    """Draft tokens fed at positions num_valid, num_valid + 1, ...: valid where the request kept them."""
    num_marked: int = 0
    """Leading blocks of the request marked in `_block_marks`."""


@dataclass(slots=True)
class DraftRequest:
    """One request of a drafting round: at most `num_drafts` drafts, in slots `block_ids` already holds."""

    request: Request
    num_drafts: int
    block_ids: list[int]
    generator: torch.Generator | None


def draft_kv_bytes_per_block(config: EngineConfig, draft_path: str) -> int:
    """The draft model's KV bytes per block of `config.block_size` tokens (the target's dtype and KV cache
    format)."""
    from izh.engine.model_runner import resolve_device, resolve_dtype

    mc = load_model_config(draft_path)
    dtype = resolve_dtype(config.dtype, resolve_device(config.device))
    try:
        fmt = kv_cache_format(config.kv_cache_dtype, dtype)
    except ValueError as exc:
        raise ModelLoadError(f"engine.kv_cache_dtype: {exc}") from None
    per_token = fmt.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    return config.block_size * per_token


def resolve_draft_path(config: EngineConfig) -> str:
    """The draft model's local path (a file, a folder or a pulled registry name; never downloaded here)."""
    from pathlib import Path

    from izh.hub import default_cache_dir, resolve_model

    spec = config.speculative
    assert spec is not None and spec.model is not None
    cache = Path(config.cache_dir).expanduser() if config.cache_dir else default_cache_dir()
    try:
        return str(resolve_model(spec.model, cache, download=False))
    except IzhError as exc:
        raise ModelLoadError(f"the draft model: {exc.message}") from exc


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's (ModelLoadError)."""
    if draft_vocab != target_vocab:
        raise ModelLoadError(
            f"the draft model's vocabulary has {draft_vocab} tokens, the served model's {target_vocab}: "
            "a draft model must share the served model's tokenizer"
        )
    target_ids = target.backend.get_vocab(with_added_tokens=True)
    draft_ids = draft.backend.get_vocab(with_added_tokens=True)
    if target_ids != draft_ids:
        differing = sorted(
            (
                token
                for token in target_ids.keys() | draft_ids.keys()
                if target_ids.get(token) != draft_ids.get(token)
            ),
            key=lambda token: min(target_ids.get(token, 1 << 62), draft_ids.get(token, 1 << 62)),
        )
        token = differing[0]
        raise ModelLoadError(
            f"the draft model's tokenizer differs from the served model's ({len(differing)} tokens differ; "
            f"{token!r} is id {target_ids.get(token)} in the served model, {draft_ids.get(token)} in the "
            "draft): a draft model must share the served model's tokenizer"
        )


class DraftModelProposer:
    """The draft model, its per-request KV state, and one drafting round over a batch of requests."""

    def __init__(self, config: EngineConfig, target: ModelRunner, target_tokenizer: Tokenizer) -> None:
        spec = config.speculative
        assert spec is not None and spec.method == "draft_model" and spec.model is not None
        if config.tensor_parallel_size > 1:
            raise ModelLoadError("a draft model runs with tensor_parallel_size 1 only")
        if target.is_encoder or target.model_config.vision is not None:
            raise ModelLoadError("a draft model drafts for a text-only generative model")
        path = resolve_draft_path(config)
        draft_model_config = load_model_config(path)
        check_same_vocabulary(
            target_tokenizer, load_tokenizer(path), target.vocab_size, draft_model_config.vocab_size
        )
        if draft_model_config.max_position_embeddings < target.max_model_len:
            raise ModelLoadError(
                f"the draft model's context ({draft_model_config.max_position_embeddings} tokens) is "
                f"shorter than max_model_len {target.max_model_len}; lower --max-model-len"
            )
        draft_config = dataclasses.replace(
            config,
            model=path,
            max_model_len=target.max_model_len,
            speculative=None,
            lora_modules=(),
            enable_lora=False,
        )
        self.spec: SpeculativeConfig = spec
        self.runner = ModelRunner(draft_config, num_blocks=target.num_blocks)
        self.block_size = target.block_size
        self.max_batched_tokens = config.max_num_batched_tokens or default_batched_tokens(target.device.type)
        self._states: dict[str, _DraftState] = {}
        self._block_marks: dict[int, bytes] = {}
        """Block id -> the hash of the block whose every slot holds draft KV of that block's tokens."""
        self.num_catch_up_tokens = 0
        """Tokens the draft computed to catch up (cumulative): prompts, and the target's own tokens."""
        self.draft_probs: dict[str, torch.Tensor] = {}
        """The last round's q [num_drafts, vocab] per random request, for the next step's verification."""
        logger.info("draft model %s loaded (%d drafts per step)", path, spec.num_speculative_tokens)

    def worth_drafting(self, request: Request, block_ids: list[int]) -> bool:
        """Whether the tokens the draft must catch up on are few enough for what the request has left."""
        catch_up = request.num_tokens - self._valid_prefix(request, block_ids)
        left = request.max_tokens - request.num_output_tokens
        return catch_up <= _DECODE_TAIL or catch_up <= _CATCH_UP_PER_TOKEN_LEFT * left

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.draft_probs.pop(request_id, None)

    # --- a round ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> dict[str, list[int]]:
        """Up to `num_drafts` drafts for each request of `batch` (each at its decode: one known token not
        yet computed by the target, KV slots held up to the last draft's position)."""
        self.draft_probs = {}
        if not batch:
            return {}
        starts = [self._valid_prefix(d.request, d.block_ids) for d in batch]
        marked = [self._num_marked(d.request, start) for d, start in zip(batch, starts, strict=True)]
        self.num_catch_up_tokens += sum(
            d.request.num_tokens - start for d, start in zip(batch, starts, strict=True)
        )
        # 1. The catch-up: prefill chunks for all but the last _DECODE_TAIL tokens, then decode rows.
        self._prefill(batch, starts)
        ends = [d.request.num_tokens for d in batch]
        pieces = [
            (d, list(range(max(start, end - _DECODE_TAIL), end)))
            for d, start, end in zip(batch, starts, ends, strict=True)
        ]
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        active = list(range(len(batch)))
        rows = [(d, positions, [d.request.all_token_ids[p] for p in positions]) for d, positions in pieces]
        stopped: set[int] = set()
        num_fed = [0] * len(batch)
        while True:
            self._pick(batch, active, self._decode_rows(rows), drafts, probs, stopped)
            active = [k for k in active if len(drafts[k]) < batch[k].num_drafts and k not in stopped]
            if not active:
                break
            # 2. The next decode step: each active request's last draft, at the position after it.
            rows = [(batch[k], [ends[k] - 1 + len(drafts[k])], [drafts[k][-1]]) for k in active]
            for k in active:
                num_fed[k] += 1
        for k, d in enumerate(batch):
            request = d.request
            self._states[request.request_id] = _DraftState(
                num_preemptions=request.num_preemptions,
                num_valid=ends[k],
                fed=drafts[k][: num_fed[k]],
                num_marked=self._mark_blocks(d, marked[k], ends[k], num_fed[k]),
            )
            if probs[k]:
                self.draft_probs[request.request_id] = torch.stack(probs[k])
        return {d.request.request_id: drafts[k] for k, d in enumerate(batch)}

    def _num_marked(self, request: Request, start: int) -> int:
        """The request's leading blocks already marked (those of its valid prefix, for a new state)."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return start // self.block_size
        return state.num_marked

    def _mark_blocks(self, d: DraftRequest, num_marked: int, end: int, num_fed: int) -> int:
        """Mark the request's blocks now full of valid draft KV (positions < `end`, past its `num_marked`
        leading ones); unmark those this round fed drafts into. Returns its marked blocks."""
        bs = self.block_size
        hashes = d.request.block_hashes
        full = min(end // bs, len(hashes))
        for j in range(num_marked, full):
            self._block_marks[d.block_ids[j]] = hashes[j]
        # Drafts were fed at positions end .. end + num_fed - 1.
        for j in range(end // bs, (end + num_fed - 1) // bs + 1 if num_fed else end // bs):
            self._block_marks.pop(d.block_ids[j], None)
        return max(num_marked, full)

    def _marked_prefix(self, request: Request, block_ids: list[int]) -> int:
        """Positions covered by the request's leading blocks whose draft KV is that of their tokens."""
        hashes = request.block_hashes
        num_blocks = 0
        while (
            num_blocks < min(len(hashes), len(block_ids))
            and self._block_marks.get(block_ids[num_blocks]) == hashes[num_blocks]
        ):
            num_blocks += 1
        return num_blocks * self.block_size

    def _valid_prefix(self, request: Request, block_ids: list[int]) -> int:
        """How many leading positions of the request the draft's KV holds: its state's, or for a request
        new to the draft (or preempted since), the marked blocks it holds."""
        state = self._states.get(request.request_id)
        if state is None or state.num_preemptions != request.num_preemptions:
            return min(self._marked_prefix(request, block_ids), request.num_tokens - 1)
        tokens = request.all_token_ids
        valid = state.num_valid
        for token in state.fed:
            if valid >= len(tokens) - 1 or tokens[valid] != token:
                break
            valid += 1
        # The last known token is never valid here: the round starts by computing it.
        return min(valid, request.num_tokens - 1)

    def _prefill(self, batch: list[DraftRequest], starts: list[int]) -> None:
        """Compute each request's positions [start, num_tokens - _DECODE_TAIL) in prefill chunks of at
        most the step's token budget (no logits); `starts` advance in place."""
        while True:
            pieces: list[tuple[DraftRequest, int, int]] = []
            budget = self.max_batched_tokens
            for k, d in enumerate(batch):
                stop = d.request.num_tokens - _DECODE_TAIL
                if starts[k] >= stop or budget == 0:
                    continue
                count = min(stop - starts[k], budget)
                pieces.append((d, starts[k], count))
                starts[k] += count
                budget -= count
            if not pieces:
                return
            tokens = [t for d, start, count in pieces for t in d.request.all_token_ids[start : start + count]]
            meta = AttentionMetadata.from_block_tables(
                [count for _, _, count in pieces],
                [start + count for _, start, count in pieces],
                [d.block_ids for d, _, _ in pieces],
                self.block_size,
                self.runner.device,
            )
            positions = [p for _, start, count in pieces for p in range(start, start + count)]
            self._forward(tokens, positions, meta)

    def _decode_rows(self, rows: list[tuple[DraftRequest, list[int], list[int]]]) -> torch.Tensor:
        """Single-token decode rows (positions, tokens) of each request, in one forward; the logits of
        each request's last row [len(rows), vocab]. Every layer writes the batch's KV before it attends,
        so a request's later rows see its earlier ones."""
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        tokens: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for d, request_positions, request_tokens in rows:
            for position, token in zip(request_positions, request_tokens, strict=True):
                query_lens.append(1)
                seq_lens.append(position + 1)
                tables.append(d.block_ids)
                tokens.append(token)
                positions.append(position)
            last_rows.append(len(tokens) - 1)
        meta = AttentionMetadata.from_block_tables(
            query_lens, seq_lens, tables, self.block_size, self.runner.device
        )
        hidden = self._forward(tokens, positions, meta)
        index = to_device(torch.tensor(last_rows, dtype=torch.long), self.runner.device)
        model = self.runner.model
        return model.compute_logits(
            hidden.index_select(0, index), out=self.runner.logits_buffer(len(last_rows))
        )

    def _forward(self, tokens: list[int], positions: list[int], meta: AttentionMetadata) -> torch.Tensor:
        dev = self.runner.device
        input_ids = to_device(torch.tensor(tokens, dtype=torch.long), dev)
        positions_t = to_device(torch.tensor(positions, dtype=torch.long), dev)
        return self.runner.model(input_ids, positions_t, meta)  # [num_tokens, hidden_size]

    def _pick(
        self,
        batch: list[DraftRequest],
        active: list[int],
        logits: torch.Tensor,
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
        stopped: set[int],
    ) -> None:
        """Each active request's next draft from its row of `logits` (row i: active[i]): the argmax for a
        greedy request, a sample of q for a random one (q kept), after its masks and penalties.

        With draft_p_min, a greedy request whose argmax has less probability (the draft's softmax before
        masks and penalties) drafts nothing more; a random one keeps the token it sampled (its q is what
        verification weighs it by) and stops after it, so that each proposed token is still q's sample."""
        p_min = self.spec.draft_p_min
        p_top: list[float] = []
        if p_min > 0.0:
            raw = logits[: len(active)]
            p_top = torch.exp(raw.max(dim=-1).values - torch.logsumexp(raw, dim=-1)).tolist()
        rows = []
        for k in active:
            request = batch[k].request
            rows.append(
                SamplingRow(
                    params=request.sampling_params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids + drafts[k],
                    eos_token_ids=request.eos_token_ids,
                    generator=batch[k].generator,
                )
            )
        metadata = SamplingMetadata.build(rows, self.runner.vocab_size, self.runner.device)
        _, greedy, random_probs = self.runner.sampler.distributions(logits[: len(active)], metadata)
        greedy_ids = greedy.tolist() if greedy is not None else None
        for i, k in enumerate(active):
            request = batch[k].request
            if request.sampling_params.is_greedy:
                assert greedy_ids is not None
                if p_top and p_top[i] < p_min and drafts[k]:
                    stopped.add(k)  # (the first draft always goes: a round without any costs as much)
                    continue
                drafts[k].append(int(greedy_ids[i]))
                continue
            assert random_probs is not None
            token, q = sample_draft(random_probs[i], batch[k].generator)
            drafts[k].append(token)
            probs[k].append(q)
            if p_min > 0.0 and float(q[token]) < p_min:
                stopped.add(k)

    def shutdown(self) -> None:
        self.runner.shutdown()
