"""Tensor parallelism inside the model: the sharded layers and the pass that turns a built decoder into
one rank's shard.

Megatron's split, one all-reduce per block half:
- q/k/v and gate/up are column-parallel (`ColumnParallelLinear`): each rank holds a contiguous slice of
  every checkpoint projection's output rows (whole heads for q/k/v), so attention and the SiLU gate run
  on local data only;
- o_proj and down_proj are row-parallel (`RowParallelLinear`): each rank holds the matching slice of the
  input columns, computes a partial product and all-reduces it (the bias is added once, after);
- the embedding is vocabulary-parallel (`VocabParallelEmbedding`: a masked lookup of the rank's rows,
  all-reduced), and so is the LM head: each rank computes the logits of its vocabulary slice and
  `compute_logits` gathers them on rank 0, which samples.

A rank's KV cache then holds only its KV heads. The loader fills these layers with slices of the
checkpoint tensors (`izh.model.weights`: each layer says which slice of which tensor it takes), so no rank
ever reads or holds the full model. This module knows tensors and `torch.distributed` only; starting the
ranks, the step plan and the worker loop are the engine's (`izh.engine.tp_worker`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from izh.errors import ModelLoadError, UnsupportedModel
from izh.model.layers import Linear, RotaryEmbedding, VocabEmbedding

if TYPE_CHECKING:
    from izh.model.config import ModelConfig
    from izh.model.llama import LlamaForCausalLM


class TensorParallel:
    """This rank's place in the tensor-parallel group and its collectives, with their time counted
    (`comm_s`, `comm_calls`, `comm_bytes`: for the benchmark's split of a step)."""

    def __init__(self, rank: int, world_size: int, group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.comm_s = 0.0
        self.comm_calls = 0
        self.comm_bytes = 0

    def all_reduce_(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same result."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count(start, x)
        return x

    def gather_to_first(self, x: Tensor) -> list[Tensor] | None:
        """Every rank's `x` (same shape on all) on rank 0, in rank order; None on the other ranks."""
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        self._count(start, x)
        return parts

    def _count(self, start: float, x: Tensor) -> None:
        self.comm_s += time.perf_counter() - start
        self.comm_calls += 1
        self.comm_bytes += x.numel() * x.element_size()


def split_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of `rank`'s equal slice of `size` items (`size` divisible by `world_size`)."""
    per = size // world_size
    return rank * per, (rank + 1) * per


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of `rank`'s vocabulary slice: ceil(vocab / N) rows each, the last rank's shorter."""
    per = -(-vocab_size // world_size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size)


class ColumnParallelLinear(Linear):
    """A Linear whose output rows are split: for each checkpoint shard (q/k/v, gate/up, or the one
    tensor), this rank holds rows `source_ranges[i]` of it, stacked as the base class stacks shards."""

    def __init__(
        self,
        in_features: int,
        source_ranges: Sequence[tuple[int, int]],
        full_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        shard_names: Sequence[str] | None = None,
    ) -> None:
        local_sizes = [end - start for start, end in source_ranges]
        super().__init__(in_features, local_sizes, bias=bias, dtype=dtype, shard_names=shard_names)
        self.source_ranges = tuple(source_ranges)
        self.full_sizes = tuple(full_sizes)


class RowParallelLinear(Linear):
    """A Linear whose input columns are split: this rank holds columns `source_range` of the checkpoint
    weight, multiplies its slice of the input and all-reduces the partial sums; the bias (whole on every
    rank) is added once, after the reduction."""

    def __init__(
        self, full_in_features: int, out_features: int, tp: TensorParallel, *, bias: bool, dtype: torch.dtype
    ) -> None:
        start, end = split_range(full_in_features, tp.rank, tp.world_size)
        super().__init__(end - start, (out_features,), bias=bias, dtype=dtype)
        self.source_range = (start, end)
        self.full_in_features = full_in_features
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        packed = self.packed
        y = (
            packed.matmul(x)
            if packed is not None and x.shape[0] <= packed.max_rows
            else F.linear(x, self.weight)
        )
        self.tp.all_reduce_(y)
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's rows [vocab_start, vocab_end) of the embedding table; a token outside them looks up
    zeros, and the all-reduce sums the one rank that holds each token's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, *, dtype: torch.dtype) -> None:
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, tp.rank, tp.world_size)
        super().__init__(self.vocab_end - self.vocab_start, hidden_size, dtype=dtype)
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, input_ids: Tensor) -> Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce_(out)


def supported_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes this model splits into: those dividing its attention heads, its KV heads
    and its MLP width (and not above its vocabulary)."""
    width = math.gcd(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
    return [n for n in range(1, width + 1) if width % n == 0 and n <= config.vocab_size]


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raise ModelLoadError when the model cannot be split `world_size` ways, naming the sizes that work."""
    if config.is_encoder:
        raise ModelLoadError(
            f"tensor_parallel_size {world_size}: tensor parallelism serves decoder models only, and "
            f"{config.architecture} is an encoder; use --tensor-parallel-size 1"
        )
    if config.architecture in ("gemma2", "gemma3"):
        raise UnsupportedModel(
            f"tensor_parallel_size {world_size}: {config.architecture}'s layers are not split across ranks; "
            "use --tensor-parallel-size 1"
        )
    if config.vision is not None:
        raise ModelLoadError(
            f"tensor_parallel_size {world_size}: the vision encoder of {config.architecture} is not split "
            "across ranks; serve this vision-language model with --tensor-parallel-size 1"
        )
    if config.moe is not None:
        raise ModelLoadError(
            f"tensor_parallel_size {world_size}: the experts of {config.architecture} are not split across "
            "ranks; serve this mixture-of-experts model with --tensor-parallel-size 1"
        )
    problems = [
        f"{name} {value}"
        for name, value in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads),
            ("intermediate_size", config.intermediate_size),
        )
        if value % world_size
    ]
    if problems:
        sizes = ", ".join(str(n) for n in supported_sizes(config))
        raise ModelLoadError(
            f"tensor_parallel_size {world_size} does not divide the model's {' and '.join(problems)} "
            f"(each rank takes whole heads); this model works with --tensor-parallel-size {sizes}"
        )


def shard_model(model: LlamaForCausalLM, tp: TensorParallel) -> None:
    """Replace, in place, the layers of a built (typically meta-device) decoder by `tp.rank`'s shards:
    column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj, the vocabulary-parallel
    embedding and LM head; the attention modules then count their local heads. New parameters are created
    on the current default device, uninitialized, for the loader to fill."""
    from izh.model.llama import DecoderAttention, DecoderLayer

    config = model.config
    check_tensor_parallel(config, tp.world_size)
    n, r, dtype = tp.world_size, tp.rank, model.dtype
    for module in model.model.layers:
        layer = cast(DecoderLayer, module)
        attn = cast(DecoderAttention, layer.self_attn)
        head_dim = attn.head_dim
        q_size, kv_size = attn.num_heads * head_dim, attn.num_kv_heads * head_dim
        attn.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [split_range(q_size, r, n), split_range(kv_size, r, n), split_range(kv_size, r, n)],
            (q_size, kv_size, kv_size),
            bias=attn.qkv_proj.bias is not None,
            dtype=dtype,
            shard_names=attn.qkv_proj.shard_names,
        )
        attn.o_proj = RowParallelLinear(
            q_size, config.hidden_size, tp, bias=attn.o_proj.bias is not None, dtype=dtype
        )
        attn.num_heads //= n
        attn.num_kv_heads //= n
        mlp = layer.mlp
        inter = config.intermediate_size
        mlp.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            [split_range(inter, r, n), split_range(inter, r, n)],
            (inter, inter),
            bias=False,
            dtype=dtype,
            shard_names=("gate_proj", "up_proj"),
        )
        mlp.down_proj = RowParallelLinear(inter, config.hidden_size, tp, bias=False, dtype=dtype)
        mlp.intermediate_size = inter // n
    model.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dtype)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(
            config.hidden_size,
            [vocab_range(config.vocab_size, r, n)],
            (config.vocab_size,),
            bias=False,
            dtype=dtype,
        )


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give a model built on the meta device real (uninitialized) storage on `device`, and recompute the
    buffers no checkpoint holds (RoPE's cos/sin table)."""
    model.to_empty(device=device)
    with torch.device(device):
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.cos_sin_cache = module._compute_cache(module.cos_sin_cache.dtype)


def compute_logits(
    model: LlamaForCausalLM, hidden_states: Tensor, tp: TensorParallel, out: Tensor | None = None
) -> Tensor | None:
    """The vocabulary-parallel LM head: every rank computes the float32 logits of its vocabulary slice
    for hidden states [n, hidden_size] (the same on every rank), and rank 0 gets them all, [n,
    vocab_size] (in `out` when given, [>= n, vocab_size]); the other ranks get None. Every rank must
    call it, with the same n."""
    vocab = model.config.vocab_size
    per = -(-vocab // tp.world_size)
    n = hidden_states.shape[0]
    head = model.packed_lm_head
    if head is not None and n <= head.max_rows:
        local = head.matmul(hidden_states)
    else:
        weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        local = F.linear(hidden_states, weight)
    part = hidden_states.new_zeros(n, per, dtype=torch.float32)
    part[:, : local.shape[1]] = local
    parts = tp.gather_to_first(part)
    if parts is None:
        return None
    logits = torch.cat(parts, dim=1)[:, :vocab]
    if out is None:
        return logits
    return out[:n].copy_(logits)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and packed weights on this rank (the loader's share)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None:
            total += packed.nbytes
    head = getattr(model, "packed_lm_head", None)
    return total + (head.nbytes if head is not None else 0)
