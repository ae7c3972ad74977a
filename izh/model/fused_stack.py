"""Decode steps through the whole decoder stack in C: one `izh.kernels.cpu.decode_stack` call per
`qgemm_max_rows()` sequences (64 with AMX) for steps of up to `MAX_CHUNKS` such calls in bfloat16, and one
call for a float32 decode step of any size (its record matmuls take any number of rows).

A single-stream decode step of a small model on a CPU spends as long in Python between the kernels
(module calls, views, ctypes, ~80 us a layer) as in the layer's matmuls. When every linear of a Llama-style
model holds izh's packed records (or, in float32, a GGUF file's own blocks: `cpu_ops.STACK_GGUF` linears,
each of its parts through `izh_gguf_matmul_f32` as `GGUFBlocks.matmul` calls it), the C side can run the
same kernels in the same order itself: its output is bit-identical to the module path's, which stays the
definition (and runs everything else: prefills, mixed steps, larger decode steps, per-head q/k norms,
other backends).

Decode steps with LoRA adapter tokens stay on the stack: it is given the adapters' stacked A and Bt buffers
(izh.model.lora, one pointer pair per layer and linear, built once per `LoraModel`) and each token's slot,
and adds the deltas after each record matmul (csrc/lora.c). In float32 the module path's hooks call the same
kernel (`cpu_ops.lora_add_`), so a token's deltas are bit-identical on either path; in bfloat16 the hooks'
`bmm`s sum in another order (tokens equal but for near ties).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from izh.kernels import cpu as cpu_ops
from izh.kernels.cpu.gguf_blocks import GGUF_BLOCK_TYPES
from izh.model.attention import AttentionMetadata, PagedTorchAttentionBackend
from izh.model.config import ModelConfig
from izh.model.layers import Linear
from izh.model.lora import LoraModel
from izh.model.packed import RECORDS_ANY_ROWS, GGUFBlocks, Q4Records, Q8Records

MAX_CHUNKS = 4
"""Decode steps of up to 4 x `qgemm_max_rows()` tokens (256 with AMX) take the stack; larger ones run the
modules (dense bf16 matmuls). Measured on 2 cores with AMX, SmolLM2 (benchmarks/offline_throughput.py): a
step of 128 decodes 106 ms chunked vs 148 ms dense, of 256 decodes 205 vs 226 ms."""


@dataclass(frozen=True, slots=True)
class StackLayer:
    """What the stack reads of one decoder layer (the model assembles these: this module knows no model)."""

    input_norm: Tensor
    post_attention_norm: Tensor
    kv_cache: Tensor | None
    linears: tuple[Linear, Linear, Linear, Linear]
    """qkv_proj, o_proj, gate_up_proj, down_proj, in the table's order."""


class FusedDecodeStack:
    """The pointer table of one model's layers (weights, norms, KV caches) for `cpu_ops.decode_stack`.

    Holds raw pointers: build it after the weights are packed and the KV caches bound, and drop it when
    either changes (`LlamaForCausalLM.bind_kv_caches` does).
    """

    def __init__(self, config: ModelConfig, table: Tensor, final_norm: Tensor, kv_cache: Tensor) -> None:
        self.table = table
        self.dims = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
        )
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.final_norm = final_norm
        self.kv_geometry = (int(kv_cache.shape[1]), int(kv_cache.shape[2]), cpu_ops.KV_TYPES[kv_cache.dtype])
        self._parts: list[Tensor] = []
        """The GGUF linears' part tables the table points at (kept alive with it)."""
        self._lora: tuple[LoraModel, Tensor | None] | None = None
        """The LoRA table of the last `LoraModel` seen (None in its place: the stack cannot take it)."""

    @classmethod
    def build(
        cls, config: ModelConfig, dtype: torch.dtype, layers: Sequence[StackLayer], final_norm: Tensor
    ) -> FusedDecodeStack | None:
        """The stack for a model's `layers` (in order) and final norm weight, or None when it cannot run
        fused: not a float32 or bfloat16 CPU model, no C kernels for its dtype here, per-head q/k norms, a
        linear without izh's records (or, in float32, GGUF blocks), no bound KV cache, or a partial rotary
        (its RoPE rotates whole heads). The KV caches may hold any format of `engine.kv_cache_dtype`: the
        stack's attention converts as it writes and reads, as the module path's does."""
        if config.rope_dim != config.head_dim:
            return None
        if dtype == torch.float32:
            kernels = cpu_ops.records_f32_available()
        else:
            kernels = dtype == torch.bfloat16 and cpu_ops.qgemm_available()
        if not kernels or config.qk_norm:
            return None
        rows: list[list[int]] = []
        keep: list[Tensor] = []
        storage = layers[0].kv_cache.dtype if layers and layers[0].kv_cache is not None else None
        for layer in layers:
            kv_cache = layer.kv_cache
            if kv_cache is None or not kv_cache.is_cpu or not kv_cache.is_contiguous():
                return None
            if kv_cache.dtype not in cpu_ops.KV_TYPES or kv_cache.dtype != storage:
                return None
            row = [
                layer.input_norm.data_ptr(),
                layer.post_attention_norm.data_ptr(),
                kv_cache.data_ptr(),
            ]
            for linear in layer.linears:
                fields = linear_fields(linear, dtype, keep)
                if fields is None:
                    return None
                row.extend(fields)
            rows.append(row)
        first_cache = layers[0].kv_cache if layers else None
        if first_cache is None or not final_norm.is_contiguous():
            return None
        table = torch.tensor(rows, dtype=torch.int64)
        assert table.shape[1] == cpu_ops.STACK_FIELDS
        stack = cls(config, table, final_norm, first_cache)
        stack._parts = keep
        return stack

    def applies(self, input_ids: Tensor, attn_metadata: AttentionMetadata, backend: object) -> bool:
        """This step is single-token decodes only, at most `max_tokens`, through the paged CPU backend."""
        return (
            attn_metadata.max_query_len == 1
            and input_ids.shape[0] <= self.max_tokens
            and type(backend) is PagedTorchAttentionBackend
        )

    @property
    def max_tokens(self) -> int:
        """Decodes per step it takes: `MAX_CHUNKS` calls of `qgemm_max_rows()` sequences each in bfloat16;
        any number in float32."""
        rows = self.chunk_rows
        return rows if rows >= RECORDS_ANY_ROWS else MAX_CHUNKS * rows

    @property
    def chunk_rows(self) -> int:
        """Sequences per C call: `qgemm_max_rows()` in bfloat16, any number in float32."""
        return RECORDS_ANY_ROWS if self.final_norm.dtype == torch.float32 else cpu_ops.qgemm_max_rows()

    def lora_table(self, lora: LoraModel) -> Tensor | None:
        """The C side's LoRA table (int64 [layers, STACK_LORA_FIELDS]) for `lora`'s buffers, built once per
        `LoraModel`; None when the stack cannot add its deltas (a buffer not a contiguous CPU tensor of the
        stack's dtype, another number of layers): such steps run the modules."""
        if self._lora is None or self._lora[0] is not lora:
            self._lora = (lora, _lora_table(lora, self.final_norm.dtype, int(self.table.shape[0])))
        return self._lora[1]

    def run(
        self,
        hidden_states: Tensor,
        cos_sin: Tensor,
        attn_metadata: AttentionMetadata,
        lora: LoraModel | None = None,
    ) -> Tensor:
        """Final-normed hidden states for the embeddings `hidden_states` [M, hidden] (overwritten).

        Over `qgemm_max_rows()` decodes, consecutive chunks of that many sequences go through the stack
        one after the other (a decode's layers see only its own sequence). With `lora` (whose batch is this
        step's, and `lora_table(lora)` not None), the adapter tokens get their deltas."""
        slot_mapping = _as(attn_metadata.slot_mapping, torch.int64)
        block_tables = _as(attn_metadata.block_tables, torch.int32)
        seq_lens = _as(attn_metadata.seq_lens, torch.int32)
        num_tokens = hidden_states.shape[0]
        rows = self.chunk_rows
        lora_args: tuple[Tensor, int, Tensor, Tensor] | None = None
        if lora is not None and lora.batch is not None:
            table = self.lora_table(lora)
            assert table is not None, "run a LoRA step on the stack only when lora_table() has a table"
            assert lora.batch.row_slots.shape[0] == num_tokens, "the LoRA batch is another step's"
            lora_args = (table, lora.max_rank, lora.batch.row_slots, lora.slot_ranks)
        outs = []
        for a in range(0, num_tokens, rows):
            b = min(a + rows, num_tokens)
            chunk_lora = None
            if lora_args is not None:
                chunk_lora = (lora_args[0], lora_args[1], lora_args[2][a:b], lora_args[3])
            outs.append(
                cpu_ops.decode_stack(
                    self.table,
                    self.dims,
                    self.eps,
                    self.scale,
                    hidden_states[a:b],
                    self.final_norm,
                    cos_sin[a:b],
                    self.kv_geometry,
                    slot_mapping[a:b],
                    block_tables[a:b],
                    seq_lens[a:b],
                    chunk_lora,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def linear_fields(linear: Linear, dtype: torch.dtype, keep: list[Tensor]) -> list[int] | None:
    """(records pointer, kind 4 or 8, bias pointer or 0) for a linear packed with izh's records; for one in
    a GGUF file's blocks (float32 only), (parts table, STACK_GGUF, bias), the table appended to `keep`."""
    packed = linear.packed
    bias = linear.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    bias_ptr = 0 if bias is None else bias.data_ptr()
    if isinstance(packed, GGUFBlocks) and dtype == torch.float32:
        parts = [len(packed.parts)]
        for part in packed.parts:
            if part.raw.stride(1) != 1:
                return None
            type_id = GGUF_BLOCK_TYPES[part.ggml_type][0]
            parts += [type_id, part.raw.data_ptr(), part.raw.stride(0), part.rows]
        keep.append(torch.tensor(parts, dtype=torch.int64))
        return [keep[-1].data_ptr(), cpu_ops.STACK_GGUF, bias_ptr]
    if not isinstance(packed, Q4Records | Q8Records):
        return None
    return [packed.records.data_ptr(), packed.kind, bias_ptr]


def _lora_table(lora: LoraModel, dtype: torch.dtype, num_layers: int) -> Tensor | None:
    """(A, Bt, n, shard bounds padded to 4) per linear and layer, or None where the C side cannot read them."""
    if len(lora.layers) != num_layers:
        return None
    rows: list[list[int]] = []
    for linears in lora.layers:
        row: list[int] = []
        for lin in linears:
            buffers = (lin.a, lin.bt)
            if any(t.dtype != dtype or not t.is_cpu or not t.is_contiguous() for t in buffers):
                return None
            if len(lin.shard_bounds) > 4:
                return None
            bounds = lin.shard_bounds + [0] * (4 - len(lin.shard_bounds))
            row += [lin.a.data_ptr(), lin.bt.data_ptr(), len(lin.projections), *bounds]
        rows.append(row)
    table = torch.tensor(rows, dtype=torch.int64)
    assert table.shape[1] == cpu_ops.STACK_LORA_FIELDS
    return table


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()
