"""The packing pass: which weight format (`izh.model.packed`) each linear of a loaded model gets.

`resolve_quantization` turns the configured mode (auto, none, int4, int8) into the one this engine runs;
`pack_model_weights` then gives every Linear, and the LM head, its packed copy.

A GGUF Q4_0 / Q4_1 tensor is exactly such an int4 tensor (group 32), so re-quantizing its dequantized
values by each group's min and max recovers the file's own 4-bit codes; likewise a Q8_0 tensor's codes by
each group's largest magnitude. For those models the packed path loses nothing beyond rounding the scales
to bfloat16.

A float32 model loaded with `gguf_blocks` goes further (`pack_gguf_blocks`, run by the loader before the
weights are read): every tensor in a type the block kernels serve keeps the file's own blocks, with no
re-quantization at all, and is never dequantized; `pack_model_weights` then leaves those linears alone.
A file whose linears are all Q4_0 / Q4_1 / Q8_0 (SmolLM2's Q4_1, say) keeps the records instead: they hold
the same codes, and on small models they are faster (SmolLM2's decode step: 2.9 ms on records against 5.0 ms
on the blocks, bench_results/README.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.model import gguf_loader
from izh.model.config import ModelConfig
from izh.model.gguf_file import GGUFFile
from izh.model.layers import Linear
from izh.model.packed import (
    TORCH_PACKED_MAX_ROWS,
    GGUFBlocks,
    GGUFPart,
    PackedWeight,
    int4_supported,
    quantize_int4,
    quantize_int8,
    quantize_q4_records,
    quantize_q8_records,
    records_supported,
)
from izh.model.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from izh.model.weights import checkpoint_targets, linear_checkpoint_names

if TYPE_CHECKING:
    from izh.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "none", "int4", "int8")

# GGUF tensor types whose values are exactly int4 with group 32 (see the module docstring).
_GGUF_INT4_TYPES = frozenset({"Q4_0", "Q4_1"})
_PARALLEL = (ColumnParallelLinear, RowParallelLinear)
# GGUF types izh's records hold with the same codes (scales rounded to bfloat16).
_RECORD_EXACT_TYPES = _GGUF_INT4_TYPES | {"Q8_0"}


def _pack_int4(weight: Tensor) -> PackedWeight:
    return quantize_q4_records(weight) if records_supported(weight) else quantize_int4(weight)


def _pack_int8(weight: Tensor) -> PackedWeight:
    return quantize_q8_records(weight) if records_supported(weight) else quantize_int8(weight)


def resolve_quantization(
    mode: str, *, device: torch.device, dtype: torch.dtype, source_types: dict[str, str]
) -> str:
    """The mode actually used: "none", "int4" or "int8".

    auto packs only what the checkpoint already stores quantized (a GGUF with Q4/Q8 tensors), and only
    where izh's kernels run it: CPU, with float32 activations (every kernel variant) or bfloat16 ones
    (AVX512-BF16, or PyTorch's kernels). An explicit int4 / int8 packs every linear (lossy for a float
    checkpoint) and needs the same conditions. `source_types` holds the checkpoint's quantized tensors
    only (`izh.model.loader.checkpoint_quant_types`).
    """
    if mode not in QUANTIZATION_MODES:
        raise ModelLoadError(f"unknown quantization {mode!r}; supported: {', '.join(QUANTIZATION_MODES)}")
    if mode == "none":
        return "none"
    usable = device.type == "cpu" and (
        dtype == torch.bfloat16 or (dtype == torch.float32 and cpu_ops.records_f32_available())
    )
    if mode == "auto":
        return "int4" if usable and source_types else "none"
    if not usable:
        why = (
            "float32 needs izh's C kernels (a C compiler, engine.cpu_kernels not off)"
            if device.type == "cpu" and dtype == torch.float32
            else f"this engine: {device.type}, {str(dtype).removeprefix('torch.')}"
        )
        raise ModelLoadError(
            f"quantization {mode} runs on CPU with float32 or bfloat16 activations ({why}); "
            "pass --quantization none"
        )
    return mode


def pack_model_weights(
    model: LlamaForCausalLM,
    mode: str,
    source_types: dict[str, str],
    *,
    requested: str,
) -> int:
    """Give every Linear (and the LM head) packed weights; returns the bytes added (net of the dense
    weights dropped, which a float32 model no longer needs: its records serve every step).

    With mode "int4", a linear is packed as int4 when int4 was asked for explicitly, or (auto) when its
    checkpoint tensors are all GGUF Q4_0 / Q4_1, which int4 holds exactly; any other linear, a shape the
    int4 kernel cannot take, and the LM head (which decides the sampled token) get int8: per group of 32
    with izh's kernels (exact for a GGUF Q8_0 tensor), per row with PyTorch's.
    """
    if mode == "none":
        return 0
    head = model.lm_head
    # float32 records serve every step, so a linear packed with them needs its dense weight no more:
    # dropping it right away keeps the load's peak memory at about the dense model's.
    records_only = model.dtype == torch.float32
    added = dropped = 0
    for linear, names in linear_checkpoint_names(model).items():
        if linear is head or isinstance(linear.packed, GGUFBlocks):
            continue
        weight = linear.weight
        if records_only and not records_supported(weight):
            continue  # a shape the records cannot take stays dense
        exact = {source_types.get(name, "F32") for name in names} <= _GGUF_INT4_TYPES
        want_int4 = mode == "int4" and (requested == "int4" or exact)
        packed = _pack_int4(weight) if want_int4 and int4_supported(weight) else _pack_int8(weight)
        linear.packed = packed
        added += packed.nbytes
        if records_only:
            dropped += weight.nbytes
            linear.weight = torch.nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
    head_weight = head.weight if head is not None else model.model.embed_tokens.weight
    if isinstance(model.packed_lm_head, GGUFBlocks):
        pass
    elif not records_only or records_supported(head_weight):
        lm_head_packed = _pack_int8(head_weight)
        model.packed_lm_head = lm_head_packed
        added += lm_head_packed.nbytes
        if records_only and head is not None:
            dropped += head_weight.nbytes
            head.weight = torch.nn.Parameter(
                head_weight.new_empty(0, head_weight.shape[1]), requires_grad=False
            )
    if records_only:
        logger.info(
            "packed %s weights as izh's records for every step (float32 activations, int8 per group of 32 "
            "in the kernels): %.1f MB, %.1f MB of dense weights freed",
            mode,
            added / 1e6,
            dropped / 1e6,
        )
    else:
        records = cpu_ops.qgemm_available()
        logger.info(
            "packed %s weights for batches of <= %d rows (%s kernels): %.1f MB",
            mode,
            cpu_ops.qgemm_max_rows() if records else TORCH_PACKED_MAX_ROWS,
            "izh" if records else "torch",
            added / 1e6,
        )
    return added - dropped


def pack_gguf_blocks(model: LlamaForCausalLM, file: GGUFFile, config: ModelConfig) -> set[str]:
    """Before the weights load: give every linear, the LM head and the token embedding whose GGUF tensors
    are in a type the block kernels serve (izh.kernels.cpu.gguf_blocks) the file's own blocks, and make
    their dense weights empty. Returns the checkpoint names so served (the loader skips them). Needs a
    float32 model and the C kernels; a model sharded for tensor parallelism keeps its dense path."""
    embed = model.model.embed_tokens
    if (
        model.dtype != torch.float32
        or not cpu_ops.records_f32_available()
        or isinstance(embed, VocabParallelEmbedding)
    ):
        return set()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if any(isinstance(m, _PARALLEL) for m in linears):
        return set()
    targets = checkpoint_targets(model)
    wanted = {name for name, target in targets.items() if any(target.param is lin.weight for lin in linears)}
    embed_name = "model.embed_tokens.weight"
    blocks = gguf_loader.block_weights(file, config, wanted | {embed_name})
    linear_types = {blocks[name][0] for name in wanted if name in blocks}
    if linear_types <= _RECORD_EXACT_TYPES:
        # Every linear fits izh's records as well, whose fused C decode stack is faster on small models:
        # the records path stays (a file with one K-quant linear turns the stack off anyway).
        return set()
    served: set[str] = set()
    added = dropped = 0
    counts: dict[str, int] = {}
    for linear in linears:
        rows = sorted(
            (target.rows or (0, linear.weight.shape[0]), name)
            for name, target in targets.items()
            if target.param is linear.weight
        )
        if not rows or any(name not in blocks for _, name in rows):
            continue  # a float tensor, or a type without a kernel: packed after loading, as before
        packed = GGUFBlocks(
            tuple(GGUFPart(*blocks[name]) for _, name in rows), linear.weight.shape[0], linear.in_features
        )
        for _, name in rows:
            counts[blocks[name][0]] = counts.get(blocks[name][0], 0) + 1
            served.add(name)
        if linear is model.lm_head:
            model.packed_lm_head = packed
        else:
            linear.packed = packed
        added += packed.nbytes
        dropped += linear.weight.nbytes
        linear.weight = torch.nn.Parameter(
            linear.weight.new_empty(0, linear.in_features), requires_grad=False
        )
    if embed_name in blocks:
        table = GGUFBlocks((GGUFPart(*blocks[embed_name]),), *embed.weight.shape)
        embed.packed = table
        served.add(embed_name)
        counts[table.parts[0].ggml_type] = counts.get(table.parts[0].ggml_type, 0) + 1
        added += table.nbytes
        if model.lm_head is None:
            model.packed_lm_head = table  # tied: the head runs in the embedding's own format
        dropped += embed.weight.nbytes
        embed.weight = torch.nn.Parameter(
            embed.weight.new_empty(0, embed.weight.shape[1]), requires_grad=False
        )
    if served:
        logger.info(
            "GGUF tensors served in their own blocks (%s): %.1f MB instead of %.1f MB of float32",
            ", ".join(f"{n} {t}" for t, n in sorted(counts.items())),
            added / 1e6,
            dropped / 1e6,
        )
    return served
