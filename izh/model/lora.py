"""LoRA adapters on a decoder's linears: reading a PEFT folder, the stacked per-slot weights, and the
batched delta of one step.

An adapter adds `scaling * B (A x)` to the output of a projection (q/k/v/o, gate/up/down), with A [r, in]
and B [out, r]; `scaling` is lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as in peft. The model
keeps `num_slots` adapters resident: every packed `Linear` of every layer gets a `LoraLinear` holding
A [slots, R * n, in] and B transposed, Bt [slots, R * n, out] (n: the checkpoint projections packed in it,
R: max_lora_rank; block-diagonal over the shards, the scaling folded in; in the model's dtype). The rank
dimension is rank-major (row j * n + i is shard i's rank-j row), so a step whose adapters have rank <= r
reads only the first r * n rows of both: rank-8 adapters in rank-16 slots cost what rank-8 slots would.

A step's batch mixes requests on the base model (slot -1) and on any of the slots. `LoraModel.set_batch`
groups the step's tokens by slot once; each linear then gathers its adapter tokens padded to
[segments, longest, in], runs two batched matmuls against its slots' A and B and scatter-adds the result
into the base output: one shrink/expand pair per linear for the whole step however many adapters it
mixes (the segmented gather-matmul of Punica / S-LoRA), never weights merged into the base, never a
forward per adapter. The deltas ride on forward hooks of the linears, so the base `Linear` (dense or
packed int4/int8) stays as it is. The fused C decode stack (izh.model.fused_stack), which bypasses the
linears, reads the same A and Bt buffers and adds the same deltas after each record matmul itself, row by
row from `LoraBatch.row_slots` (csrc/lora.c).

This module knows tensors and the model only; which adapter sits in which slot is the engine's business
(izh.engine.lora_manager).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from izh.errors import LoraAdapterError
from izh.kernels import cpu as cpu_ops
from izh.model.config import ModelConfig
from izh.model.layers import Linear

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (peft's names), in each layer."""

_PACKED_LINEARS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)
"""(module, izh's linear, the peft projections packed in it by rows, in order)."""

_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter read from disk: float32 CPU tensors, checked against the base model's shapes."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]
    """(layer index, peft projection name) -> (A [rank, in], B [out, rank])."""


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of one decoder layer."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _bad(path: str, message: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter at {path}: {message}", param="lora_path")


def read_adapter_config(path: str) -> dict[str, Any]:
    """adapter_config.json of a PEFT folder, checked for what izh serves (LoRA on the projections)."""
    folder = Path(path)
    if not folder.is_dir():
        raise _bad(path, "not a folder (expected a PEFT adapter folder with adapter_config.json)")
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        raise _bad(path, f"no {ADAPTER_CONFIG} in the folder")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"{ADAPTER_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _bad(path, f"{ADAPTER_CONFIG} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _bad(path, f"peft_type is {peft_type}; only LORA adapters are supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad(path, f"r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _bad(path, f"lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D models)",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise _bad(path, f"{what} are not supported")
    if config.get("bias", "none") != "none":
        raise _bad(path, f"bias {config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_MODULES]
        if unknown:
            raise _bad(
                path,
                f"target_modules {unknown} are not supported; izh serves LoRA on {', '.join(TARGET_MODULES)}",
            )
    return config


def load_peft_adapter(name: str, path: str, config: ModelConfig, *, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a model of `config`.

    Raises LoraAdapterError (a 400) saying what is wrong: no such folder, an unsupported option, a rank
    above `max_rank`, a tensor that is not a LoRA A/B of a target projection, or a shape that does not
    fit the base model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    adapter_config = read_adapter_config(path)
    rank: int = adapter_config["r"]
    if rank > max_rank:
        raise _bad(path, f"its rank r={rank} is above max_lora_rank {max_rank}; raise --max-lora-rank")
    alpha = float(adapter_config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    weights_path = Path(path) / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        hint = " (adapter_model.bin is not read: re-save it with safe_serialization)"
        raise _bad(
            path,
            f"no {ADAPTER_WEIGHTS} in the folder"
            + (hint if (Path(path) / "adapter_model.bin").exists() else ""),
        )
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _bad(path, f"{ADAPTER_WEIGHTS} cannot be read ({exc})") from None
    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise _bad(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in shapes:
            raise _bad(
                path, f"tensor {key!r} targets {module}; izh serves LoRA on {', '.join(TARGET_MODULES)}"
            )
        if layer >= config.num_hidden_layers:
            raise _bad(path, f"tensor {key!r} is for layer {layer}; the model has {config.num_hidden_layers}")
        in_features, out_features = shapes[module]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise _bad(
                path,
                f"tensor {key!r} has shape {list(tensor.shape)}, expected {list(expected)} (r={rank} on this "
                "base model: is the adapter for another model?)",
            )
        halves.setdefault((layer, module), {})[which] = tensor.to(torch.float32)
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise _bad(path, f"layer {layer} {module} has no {missing} weight")
        weights[(layer, module)] = (pair["A"].contiguous(), pair["B"].contiguous())
    if not weights:
        raise _bad(path, f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    targets = tuple(sorted({module for _, module in weights}, key=TARGET_MODULES.index))
    return LoraAdapter(name, str(path), rank, scaling, targets, weights)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's tokens grouped by adapter slot: what every linear's delta reads."""

    slots: Tensor
    """[S] long, on the host: the slot of each segment."""
    slots_device: Tensor
    """The same on the model's device (indexes the stacked weights)."""
    gather: Tensor
    """[S * L] long: the token row at each (segment, position); padding repeats a real row."""
    valid: Tensor | None
    """[N] long: the rows of the padded [S * L] layout that are real tokens (None: no padding)."""
    rows: Tensor
    """[N] long: the token row of each real entry (where its delta is added)."""
    num_segments: int
    length: int
    """L, the longest segment."""
    rank: int
    """The largest rank among the step's adapters (the slots' rows past it are zeros for all of them)."""
    slot_range: tuple[int, int] | None
    """(first, end) when the segments' slots are consecutive: the stacked weights are sliced, not gathered."""
    row_slots: Tensor
    """[num_tokens] int32, on the host: each token's slot, -1 for the base model (the fused stack's)."""
    contiguous_start: int | None
    """Set when the segments are equal in length and lie one after the other from this row, in slot
    order (a decode step whose batch the runner sorted by slot): the tokens are a view, not gathered, and
    the deltas are added in place, not scattered."""


class LoraLinear:
    """The resident adapters of one packed `Linear`, and its forward hook that adds their deltas."""

    def __init__(
        self,
        owner: LoraModel,
        linear: Linear,
        projections: tuple[str, ...],
        num_slots: int,
        max_rank: int,
    ) -> None:
        self.owner = owner
        self.projections = projections
        self.max_rank = max_rank
        self.rows = [(start, end) for _, start, end in linear.shard_rows()]
        assert len(self.rows) == len(projections)
        weight = linear.weight
        n = len(projections)
        out_features = self.rows[-1][1]
        self.a = torch.zeros(
            num_slots, n * max_rank, linear.in_features, dtype=weight.dtype, device=weight.device
        )
        self.bt = torch.zeros(num_slots, n * max_rank, out_features, dtype=weight.dtype, device=weight.device)
        self.shard_bounds = [self.rows[0][0]] + [end for _, end in self.rows]
        """The column bounds of the shards in the output (n + 1 numbers)."""
        self._fields: Tensor | None = None

    def set_slot(self, slot: int, adapter: LoraAdapter | None, layer: int) -> None:
        """Copy the adapter's weights for this linear into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        if adapter is None:
            return
        r = adapter.rank
        n = len(self.projections)
        for i, (projection, (start, end)) in enumerate(zip(self.projections, self.rows, strict=True)):
            pair = adapter.weights.get((layer, projection))
            if pair is None:
                continue
            a, b = pair
            self.a[slot, i : r * n : n].copy_(a)  # rank-major: rank j of shard i at row j * n + i
            self.bt[slot, i : r * n : n, start:end].copy_((b * adapter.scaling).t())

    def stack_fields(self) -> Tensor:
        """This linear's row of the C side's LoRA table (A, Bt, n, the shard bounds padded to 4), built
        once (the buffers never move)."""
        if self._fields is None:
            bounds = self.shard_bounds + [0] * (4 - len(self.shard_bounds))
            fields = [self.a.data_ptr(), self.bt.data_ptr(), len(self.projections), *bounds]
            self._fields = torch.tensor(fields, dtype=torch.int64)
        return self._fields

    def hook(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """forward hook: output += the batch's adapter deltas (in place; the base output is fresh). On a
        CPU in float32 with the C kernels, through the fused decode stack's own LoRA kernel, row by row:
        the same bits as a decode step on the stack, whatever the batch (else two `bmm`s)."""
        batch = self.owner.batch
        if batch is None:
            return output
        x = args[0]
        if len(self.shard_bounds) <= 4 and cpu_ops.lora_add_(
            x, output, self.stack_fields(), self.max_rank, batch.row_slots, self.owner.slot_ranks
        ):
            return output
        s = batch.num_segments
        k = batch.rank * len(self.projections)
        if batch.slot_range is not None:
            first, end = batch.slot_range
            a, bt = self.a[first:end, :k], self.bt[first:end, :k]
        else:
            a = self.a.index_select(0, batch.slots_device)[:, :k]
            bt = self.bt.index_select(0, batch.slots_device)[:, :k]
        start = batch.contiguous_start
        if start is not None:
            end = start + s * batch.length
            xs = x[start:end].view(s, batch.length, x.shape[-1])
        else:
            xs = x.index_select(0, batch.gather).view(s, batch.length, x.shape[-1])
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), bt)  # [S, L, out]
        if start is not None:
            output[start:end].view_as(delta).add_(delta)
            return output
        delta = delta.view(s * batch.length, -1)
        if batch.valid is not None:
            delta = delta.index_select(0, batch.valid)
        return output.index_add_(0, batch.rows, delta)


class LoraModel:
    """`num_slots` resident adapters on every decoder layer of a Llama-family model (hooks installed here)."""

    def __init__(self, layers: Sequence[nn.Module], num_slots: int, max_rank: int) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"need num_slots >= 1 and max_rank >= 1, got {num_slots}, {max_rank}")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.batch: LoraBatch | None = None
        """This step's grouping; None when no token of the step uses an adapter (the hooks do nothing)."""
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32)
        """The rank of the adapter in each slot (0: empty), on the host (the fused stack reads it)."""
        self.layers: list[list[LoraLinear]] = []
        self._device = torch.device("cpu")
        for layer in layers:
            linears = []
            for module_name, linear_name, projections in _PACKED_LINEARS:
                linear = getattr(getattr(layer, module_name), linear_name)
                assert isinstance(linear, Linear)
                lora = LoraLinear(self, linear, projections, num_slots, max_rank)
                linear.register_forward_hook(lora.hook)
                linears.append(lora)
                self._device = linear.weight.device
            self.layers.append(linears)

    @property
    def active(self) -> bool:
        """This step has adapter tokens (CUDA graphs must not run it; the fused decode stack runs it only
        with `row_slots` and its LoRA table)."""
        return self.batch is not None

    def set_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Make `slot` hold `adapter` (None clears it)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
        if adapter is not None and adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} > max_rank {self.max_rank}")
        with torch.inference_mode():
            for index, linears in enumerate(self.layers):
                for lora in linears:
                    lora.set_slot(slot, adapter, index)
        self.slot_ranks[slot] = 0 if adapter is None else adapter.rank

    def set_batch(self, segments: Sequence[tuple[int, int]], ranks: Sequence[int]) -> None:
        """Group the next forward's tokens: `segments` lists, in batch order, (slot or -1 for the base
        model, number of tokens) per request; `ranks[slot]` is the rank of the adapter in each slot.
        Call `clear_batch` after the forward."""
        by_slot: dict[int, list[tuple[int, int]]] = {}
        start = 0
        row_slots: list[int] = []
        for slot, num_tokens in segments:
            if slot >= 0 and num_tokens > 0:
                by_slot.setdefault(slot, []).append((start, start + num_tokens))
            start += num_tokens
            row_slots.extend([slot if slot >= 0 else -1] * num_tokens)
        if not by_slot:
            self.batch = None
            return
        slots = sorted(by_slot)
        lengths = [sum(end - begin for begin, end in by_slot[slot]) for slot in slots]
        length = max(lengths)
        rows: list[int] = []
        gather: list[int] = []
        valid: list[int] = []
        for i, slot in enumerate(slots):
            seg = [row for begin, end in by_slot[slot] for row in range(begin, end)]
            rows.extend(seg)
            valid.extend(range(i * length, i * length + len(seg)))
            gather.extend(seg + [seg[0]] * (length - len(seg)))
        padded = len(valid) != len(gather)
        first = by_slot[slots[0]][0][0]
        contiguous = not padded and rows == list(range(first, first + len(rows)))
        dev = self._device
        slots_host = torch.tensor(slots, dtype=torch.long)
        batch = LoraBatch(
            slots=slots_host,
            slots_device=slots_host.to(dev),
            gather=torch.tensor(gather, dtype=torch.long).to(dev),
            valid=torch.tensor(valid, dtype=torch.long).to(dev) if padded else None,
            rows=torch.tensor(rows, dtype=torch.long).to(dev),
            num_segments=len(slots),
            length=length,
            rank=max(ranks[slot] for slot in slots),
            slot_range=(slots[0], slots[-1] + 1) if slots[-1] - slots[0] == len(slots) - 1 else None,
            row_slots=torch.tensor(row_slots, dtype=torch.int32),
            contiguous_start=first if contiguous else None,
        )
        self.batch = batch

    def clear_batch(self) -> None:
        self.batch = None
