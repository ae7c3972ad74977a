"""DecodeGraphRunner: a padded, replayed decode step equals the eager step, and padding writes nowhere."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from izh.engine.cuda_graphs import DecodeGraphRunner, decode_batch_sizes
from izh.kernels import paged_attention as pa
from izh.model.attention import AttentionMetadata

BLOCK_SIZE = 16
needs_gpu = pytest.mark.skipif(not pa.is_available(), reason="needs CUDA and triton")


class ToyModel:
    """Embedding -> q/k/v projections -> write K/V -> paged attention -> output projection: the parts of a
    decoder layer that touch the KV cache and the metadata. Positions scale the embedding so they matter."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        attend: Callable[..., torch.Tensor],
        write: Callable[..., None],
    ) -> None:
        gen = torch.Generator(device=kv_cache.device).manual_seed(0)
        _, _, _, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.num_heads = num_heads
        hidden = num_heads * self.head_dim
        qkv_dim = (num_heads + 2 * self.num_kv_heads) * self.head_dim

        def weight(*shape: int) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, device=kv_cache.device) / shape[0] ** 0.5
            return w.to(kv_cache.dtype)

        self.embed = weight(100, hidden)
        self.w_qkv = weight(hidden, qkv_dim)
        self.w_out = weight(hidden, hidden)
        self.kv_cache = kv_cache
        self.attend, self.write = attend, write

    def qkv(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The q/k/v projection of a batch: [n, num_heads + 2 * num_kv_heads, head_dim]."""
        x = self.embed[input_ids] * (1 + positions[:, None].to(self.embed.dtype) / 64)  # [n, hidden]
        return (x @ self.w_qkv).view(
            input_ids.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim
        )

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, h, kvh, d = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(input_ids, positions)
        self.write(qkv[:, h : h + kvh], qkv[:, h + kvh :], self.kv_cache, meta.slot_mapping)
        q = qkv[:, :h]
        attn = self.attend(
            q,
            self.kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            d**-0.5,
            meta.max_query_len,
            meta.max_seq_len,
        )
        return attn.reshape(n, h * d) @ self.w_out


def reference_attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    return pa.paged_attention_reference(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)


def decode_step(
    num_seqs: int, context_lens: list[int], max_blocks: int, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and metadata of a decode step: sequence i owns blocks [i * max_blocks, ...)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + 1 for c in context_lens[:num_seqs]]
    tables = [[i * max_blocks + j for j in range(-(-s // BLOCK_SIZE))] for i, s in enumerate(seq_lens)]
    meta = AttentionMetadata.from_block_tables([1] * num_seqs, seq_lens, tables, BLOCK_SIZE, device)
    input_ids = torch.randint(0, 100, (num_seqs,), generator=gen).to(device)
    positions = torch.tensor([s - 1 for s in seq_lens], device=device)
    return input_ids, positions, meta


def test_decode_batch_sizes() -> None:
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_batch_sizes(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]


def test_padded_eager_run_equals_unpadded_step_on_cpu() -> None:
    """The padding path without CUDA: same rows out, same cache after, padding rows reset between runs
    (a batch of 7 then one of 5, both padded to 8, so rows 5..7 must not replay the first batch).

    Exact: every slot but this step's real ones (padding rows wrote nowhere, no stale row replayed an old
    slot), and the K/V in the real slots are bit-for-bit rows [:num_seqs] of the padded batch's own
    projection (the padding path writes what the model computed, no more, no less). Not exact: that
    projection against the unpadded one. A float32 GEMM's rows depend on the number of rows on CPU too:
    MKL's sgemm picks its kernel and its split across threads from M (with 2 threads on AVX2, rows 4..6 of
    a 7-row product differ from the same rows of the 8-row product by an ulp; and even on one thread M <= 3
    rounds differently from M >= 4), as cuBLAS does on GPU (see test_graph_replay_equals_eager). So the
    outputs and the real slots' K/V match the eager step within float32's default tolerance (64-term dot
    products of O(1) terms: a different summation order moves them by a few ulps, ~1e-7)."""
    max_blocks, num_heads = 4, 4
    cache = torch.randn(2, 8 * max_blocks, BLOCK_SIZE, 2, 16)
    eager = ToyModel(cache.clone(), num_heads, reference_attend, pa.write_kv_cache_reference)
    padded = ToyModel(cache.clone(), num_heads, reference_attend, pa.write_kv_cache_reference)
    runner = DecodeGraphRunner(
        padded,
        max_num_seqs=8,
        max_blocks_per_seq=max_blocks,
        block_size=BLOCK_SIZE,
        device="cpu",
        use_cuda_graphs=False,
    )
    h, kvh = num_heads, padded.num_kv_heads
    context_lens = [5, 16, 40, 3, 60, 20, 1, 33]
    batch_sizes = [7, 5, 3]
    for step, num_seqs in enumerate(batch_sizes):
        input_ids, positions, meta = decode_step(num_seqs, context_lens, max_blocks, "cpu", seed=step)
        assert runner.can_run(meta)
        out = runner.run(input_ids, positions, meta)
        expected = eager(input_ids, positions, meta)
        torch.testing.assert_close(out, expected)
        blocks, offsets = meta.slot_mapping // BLOCK_SIZE, meta.slot_mapping % BLOCK_SIZE
        real = torch.zeros(cache.shape[1:3], dtype=torch.bool)
        real[blocks, offsets] = True
        assert torch.equal(padded.kv_cache[:, ~real], eager.kv_cache[:, ~real])
        padded_size = next(n for n in runner.batch_sizes if n >= num_seqs)
        assert padded_size > num_seqs  # every batch here is padded
        qkv = padded.qkv(runner.input_ids[:padded_size], runner.positions[:padded_size])[:num_seqs]
        assert torch.equal(padded.kv_cache[0, blocks, offsets], qkv[:, h : h + kvh])
        assert torch.equal(padded.kv_cache[1, blocks, offsets], qkv[:, h + kvh :])
        torch.testing.assert_close(padded.kv_cache[:, real], eager.kv_cache[:, real])
        # The next step starts from the same cache, so that again only its own real slots may differ.
        padded.kv_cache.copy_(eager.kv_cache)
        context_lens = [c + 1 for c in context_lens[:num_seqs]] + context_lens[num_seqs:]
        # The sequences that leave the batch free their blocks, which get reused: a stale padding row
        # replaying its old slot would overwrite the new owner's K/V.
        leaving = batch_sizes[step + 1] if step + 1 < len(batch_sizes) else num_seqs
        for model in (eager, padded):
            model.kv_cache[:, leaving * max_blocks :] = 0.5


def test_rejects_batches_it_cannot_replay() -> None:
    runner = DecodeGraphRunner(
        lambda ids, pos, meta: ids,
        max_num_seqs=4,
        max_blocks_per_seq=2,
        block_size=BLOCK_SIZE,
        device="cpu",
        use_cuda_graphs=False,
    )
    prefill = AttentionMetadata.from_block_tables([3], [3], [[0]], BLOCK_SIZE)
    too_many = AttentionMetadata.from_block_tables([1] * 5, [1] * 5, [[i] for i in range(5)], BLOCK_SIZE)
    too_long = AttentionMetadata.from_block_tables([1], [40], [[0, 1, 2]], BLOCK_SIZE)
    for meta in (prefill, too_many, too_long):
        assert not runner.can_run(meta)
        with pytest.raises(ValueError, match="not a capturable decode batch"):
            runner.run(
                torch.zeros(meta.num_seqs, dtype=torch.long),
                torch.zeros(meta.num_seqs, dtype=torch.long),
                meta,
            )


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("padding_block_id", [None, 0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_graph_replay_equals_eager(padding_block_id: int | None, dtype: torch.dtype) -> None:
    max_blocks, num_seqs_max, num_heads = 16, 32, 8
    # With a padding block, block 0 is reserved for it and the sequences' blocks start at 1.
    first = 0 if padding_block_id is None else 1
    cache = torch.randn(2, first + num_seqs_max * max_blocks, BLOCK_SIZE, 2, 64, device="cuda").to(dtype)
    eager = ToyModel(cache.clone(), num_heads, pa.paged_attention, pa.write_kv_cache)
    graphed = ToyModel(cache.clone(), num_heads, pa.paged_attention, pa.write_kv_cache)
    runner = DecodeGraphRunner(
        graphed,
        max_num_seqs=num_seqs_max,
        max_blocks_per_seq=max_blocks,
        block_size=BLOCK_SIZE,
        device="cuda",
        padding_block_id=padding_block_id,
    )
    runner.capture()
    assert torch.equal(graphed.kv_cache[:, first:], eager.kv_cache[:, first:])  # capture wrote no real slot
    gen = torch.Generator().manual_seed(0)
    context_lens = torch.randint(0, max_blocks * BLOCK_SIZE - 8, (num_seqs_max,), generator=gen).tolist()
    for step, num_seqs in enumerate((3, 5, 13, 17, 32, 1, 7)):  # all but 32 and 1 need padding
        input_ids, positions, meta = decode_step(num_seqs, context_lens, max_blocks, "cuda", seed=step)
        meta.slot_mapping += first * BLOCK_SIZE
        meta.block_tables += first
        out = runner.run(input_ids, positions, meta).clone()
        expected = eager(input_ids, positions, meta)
        torch.cuda.synchronize()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
        # Same K/V written to the same slots; padding rows wrote nowhere outside the reserved block. (Not
        # bitwise: cuBLAS may pick another kernel for the padded batch's projections.)
        torch.testing.assert_close(graphed.kv_cache[:, first:], eager.kv_cache[:, first:], atol=tol, rtol=tol)
        context_lens = [c + 1 for c in context_lens[:num_seqs]] + context_lens[num_seqs:]
