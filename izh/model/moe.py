"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, the Llama decoder with sparse MLP blocks.

A sparse block routes each token to its top-k experts (`izh.kernels.cpu.moe.moe_route`: softmax over the
router's logits, the k most probable, renormalized where the model says), then runs every expert once on
the rows routed to it: the step's (token, expert) pairs are sorted by expert, each expert's rows gathered
into one slice and sent through that expert's gate_up and down linears (packed like any other linear by
`izh.model.packing`: no dense per-expert copies), and each token's outputs are added back in ascending
expert order, weighted. The loop is over the experts that have rows, never over tokens; with float32
activations and every expert in izh's records or a GGUF file's blocks it runs in C (`moe_experts`: one call a layer instead of
a few Python calls an expert, the same kernel calls, so the same bits).

Batch invariance: a token's experts and weights come from its own row only (the C router), and its
outputs are summed in an order fixed by its own experts; what remains batch-dependent is what the
linears themselves do with more rows (izh's records compute each row alone).

Parameter names follow transformers' Hub checkpoints: `model.layers.N.mlp.gate.weight` (the router) and
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`; Mixtral's `block_sparse_moe` / `w1 w3 w2`
names are renamed onto these by the loader, GGUF's 3-D `ffn_*_exps` tensors split per expert.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import Tensor, nn

from izh.errors import ModelLoadError
from izh.kernels.cpu.moe import moe_experts, moe_route
from izh.model.config import ModelConfig, MoeConfig
from izh.model.fused_stack import linear_fields
from izh.model.layers import GatedMLP
from izh.model.llama import LlamaForCausalLM
from izh.model.lora import LoraModel


class Router(nn.Module):
    """The router's weight [num_experts, hidden], kept in float32 whatever the model's dtype (it is small,
    and the routing decision should not move with the activations' precision)."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )


class SparseMoeBlock(nn.Module):
    """The experts of one layer and their router: y = sum over the token's top-k experts of w_e * mlp_e(x)."""

    def __init__(self, hidden_size: int, moe: MoeConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.gate = Router(moe.num_experts, hidden_size)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.expert_intermediate_size, dtype=dtype) for _ in range(moe.num_experts)
        )
        self.intermediate_size = moe.expert_intermediate_size
        self._expert_table: Tensor | None = None
        self._expert_table_built = False
        self._expert_parts: list[Tensor] = []

    def expert_table(self) -> Tensor | None:
        """int64 [E, EXPERT_FIELDS]: each expert's gate_up and down as the C experts loop reads them (izh's
        float32 records or a GGUF file's blocks), or None where an expert's linears are not packed so.
        Built on the first call, after loading and packing have settled the weights."""
        if not self._expert_table_built:
            self._expert_table_built = True
            keep: list[Tensor] = []
            rows = []
            for expert in cast("list[GatedMLP]", list(self.experts)):
                gate_up = linear_fields(expert.gate_up_proj, torch.float32, keep)
                down = linear_fields(expert.down_proj, torch.float32, keep)
                if gate_up is None or down is None:
                    return None
                rows.append(gate_up + down)
            self._expert_table = torch.tensor(rows, dtype=torch.int64)
            self._expert_parts = keep
        return self._expert_table

    def forward(self, x: Tensor) -> Tensor:
        num_tokens, hidden = x.shape
        k = self.top_k
        routing = moe_route(x, self.gate.weight, k, self.renormalize)
        table = self.expert_table() if x.dtype == torch.float32 and x.is_cpu else None
        # One C call for every expert where their linears allow (the same kernels as the loop below, so
        # the same bits), else the experts' modules one by one.
        pair_out = None if table is None else moe_experts(table, routing, x, self.intermediate_size)
        if pair_out is None:
            order = routing.order
            rows = x.index_select(0, routing.tokens)  # [T * k, hidden], grouped by expert
            pair_out = x.new_empty(num_tokens * k, hidden)  # expert outputs back in (token, slot) order
            start = 0
            for expert, count in enumerate(routing.counts):
                if count:
                    end = start + count
                    pair_out.index_copy_(0, order[start:end], self.experts[expert](rows[start:end]))
                    start = end
        pair_out = pair_out.view(num_tokens, k, hidden)
        weights = routing.weights.to(x.dtype)
        # A token's slots are in ascending expert order (moe_route's contract); transformers adds the
        # experts' weighted outputs in that order onto zeros, and so does this.
        out = pair_out[:, 0] * weights[:, 0:1]
        for slot in range(1, k):
            out += pair_out[:, slot] * weights[:, slot : slot + 1]
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose MLPs are sparse blocks (dense where `MoeConfig.dense_layers` says).

    The fused C decode stack and LoRA serve dense MLPs only, so this model runs its decode steps through
    the modules and refuses adapters."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        moe = config.moe
        if moe is None:
            raise ModelLoadError(
                f"{config.architecture}: a mixture-of-experts model needs its experts' config"
            )
        # The decoder's own dense MLPs are built empty (intermediate 0) and replaced layer by layer.
        super().__init__(replace(config, intermediate_size=0), dtype=dtype)
        self.config = config
        for index, layer in enumerate(self.model.layers):
            if moe.is_sparse(index):
                layer.mlp = SparseMoeBlock(config.hidden_size, moe, dtype=dtype)
            else:
                layer.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype)

    def prepare_fused_decode(self) -> bool:
        self.fused_stack = None
        return False

    def attach_lora(self, num_slots: int, max_rank: int) -> LoraModel:
        raise ModelLoadError(
            f"LoRA adapters are not supported on mixture-of-experts models ({self.config.architecture}); "
            "serve it without --max-loras / lora_modules"
        )


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms) with sparse blocks; norm_topk_prob from the config."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        if not config.qk_norm:
            raise ModelLoadError("a Qwen3-MoE model needs qk_norm=True (q_norm/k_norm weights)")
        super().__init__(config, dtype=dtype)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Llama's attention (no biases) with sparse blocks, top-k weights always renormalized."""
