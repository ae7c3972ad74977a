"""CUDA graphs of the decode step: capture once per padded batch size, replay with new inputs.

A decode step launches a few kernels per layer on tiny tensors, so on a GPU it is bound by launch overhead;
replaying a captured graph removes it. A graph replays fixed kernels on fixed addresses, hence:

- inputs live in static buffers sized for the largest batch, and `run` copies each batch into them;
- a batch is padded up to the next captured size; padding rows decode a dummy token at position 0 with
  seq_len 1, and their K/V go to slot -1 (skipped by `write_kv_cache`) or to a reserved scratch block;
- `model_step` must be graph-safe: no host syncs and no launch decision taken from tensor values. The Triton
  attention path is (its grid depends on shapes only, and `max_seq_len` is only an upper bound); the torch
  paged backend is not (it reads the sequence lengths on the host), so it must run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from izh.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

ModelStep = Callable[[Tensor, Tensor, AttentionMetadata], Tensor]
"""`model_step(input_ids, positions, attn_metadata) -> hidden [num_tokens, ...]`."""


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {n for n in (1, 2, 4, 8) if n <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: Tensor
    """The graph's output buffer: every replay overwrites it."""


class DecodeGraphRunner:
    """Runs decode steps (one new token per sequence) by replaying CUDA graphs captured per batch size.

    `capture()` once (after the KV caches are bound and the weights loaded), then `run()` any batch for
    which `can_run()` holds. With `use_cuda_graphs=False` the same padded static-buffer path runs eagerly,
    which makes the padding testable without CUDA.
    """

    def __init__(
        self,
        model_step: ModelStep,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str,
        batch_sizes: Sequence[int] | None = None,
        padding_block_id: int | None = None,
        use_cuda_graphs: bool = True,
    ) -> None:
        """`padding_block_id`: a cache block reserved for padding rows' K/V; None writes them to slot -1,
        which `write_kv_cache` skips (their reads then hit block 0, harmlessly: the rows are discarded)."""
        self.model_step = model_step
        self.batch_sizes = sorted(set(batch_sizes or decode_batch_sizes(max_num_seqs)))
        if self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        self.max_batch_size = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_cuda_graphs = use_cuda_graphs
        if use_cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self._padding_slot = -1 if padding_block_id is None else padding_block_id * block_size
        self._padding_block = 0 if padding_block_id is None else padding_block_id
        n, dev = self.max_batch_size, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_batch_size]
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # One token per sequence: the query offsets never change.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # [max_batch_size + 1]
        self._graphs: dict[int, _Captured] = {}

    # --- set-up ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first so that the smaller ones reuse its memory pool.

        Each capture runs on all-padding inputs, so it writes no real cache slot.
        """
        if not self.use_cuda_graphs:
            return
        pool = torch.cuda.graph_pool_handle()  # shared by all the graphs: they never run concurrently
        for batch_size in reversed(self.batch_sizes):
            self._fill_padding(0, batch_size)
            metadata = self._metadata(batch_size)
            # Warm up eagerly first: Triton compiles and cuBLAS allocates its workspace outside the graph.
            self.model_step(self.input_ids[:batch_size], self.positions[:batch_size], metadata)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.model_step(self.input_ids[:batch_size], self.positions[:batch_size], metadata)
            self._graphs[batch_size] = _Captured(graph=graph, output=output)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    # --- one step -------------------------------------------------------------------------------

    def can_run(self, attn_metadata: AttentionMetadata) -> bool:
        """Whether this step is a decode batch that fits the captured sizes and block-table width."""
        return (
            attn_metadata.max_query_len == 1
            and attn_metadata.num_seqs <= self.max_batch_size
            and attn_metadata.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    @torch.inference_mode()
    def run(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata) -> Tensor:
        """`model_step` on this decode batch, padded to the next captured size; returns its first num_seqs
        rows. The rows are a view of the graph's output buffer: valid until the next `run`."""
        if not self.can_run(attn_metadata):
            raise ValueError(
                f"not a capturable decode batch: {attn_metadata.num_seqs} sequences, max_query_len "
                f"{attn_metadata.max_query_len}, {attn_metadata.block_tables.shape[1]} blocks per sequence "
                f"(limits: {self.max_batch_size}, 1, {self.max_blocks_per_seq})"
            )
        num_seqs = attn_metadata.num_seqs
        batch_size = next(n for n in self.batch_sizes if n >= num_seqs)
        self._copy_inputs(input_ids, positions, attn_metadata)
        self._fill_padding(num_seqs, batch_size)
        captured = self._graphs.get(batch_size)
        if captured is None:
            if self.use_cuda_graphs:
                raise RuntimeError("capture() must run before run()")
            output = self.model_step(
                self.input_ids[:batch_size], self.positions[:batch_size], self._metadata(batch_size)
            )
            return output[:num_seqs]
        captured.graph.replay()
        return captured.output[:num_seqs]

    def _copy_inputs(self, input_ids: Tensor, positions: Tensor, attn_metadata: AttentionMetadata) -> None:
        n = attn_metadata.num_seqs
        width = attn_metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(attn_metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(attn_metadata.seq_lens, non_blocking=True)
        # Columns past `width` keep stale ids from earlier batches: never read, since every sequence's
        # context fits in its first `width` blocks.
        self.block_tables[:n, :width].copy_(attn_metadata.block_tables, non_blocking=True)

    def _fill_padding(self, start: int, end: int) -> None:
        """Make rows [start, end) dummy decodes: token 0 at position 0, seq_len 1, K/V to the padding slot."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self._padding_slot
        self.seq_lens[start:end] = 1
        self.block_tables[start:end] = self._padding_block

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        """Metadata over the first `batch_size` rows of the static buffers. The host seq_lens copy stays
        None on purpose: a backend that needs it must sync, which fails loudly under capture rather than
        baking the capture-time lengths into the graph."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
            query_lens_list=[1] * batch_size,
        )
