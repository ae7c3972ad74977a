"""izh.model.lora's batched delta against a per-token reference, for every way a step's tokens group."""

from __future__ import annotations

import pytest
import torch

from izh.model import load_model
from izh.model.llama import LlamaForCausalLM
from izh.model.lora import LoraAdapter, projection_shapes

SEGMENTS = {
    "one adapter, whole batch": [(0, 5)],
    "equal and consecutive (a sorted decode step)": [(-1, 2), (0, 3), (1, 3), (2, 3)],
    "unequal, interleaved with the base model": [(1, 4), (-1, 1), (0, 1), (1, 2), (-1, 3), (2, 7)],
    "slots not consecutive": [(2, 1), (0, 1), (2, 1)],
}


def _adapter(config, rank: int, seed: int, targets: tuple[str, ...]) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module, (inf, outf) in projection_shapes(config).items():
            if module in targets:
                weights[(layer, module)] = (
                    torch.randn(rank, inf, generator=g),
                    torch.randn(outf, rank, generator=g),
                )
    return LoraAdapter(f"a{seed}", "/none", rank, 0.5 + seed, targets, weights)


@pytest.mark.parametrize("case", list(SEGMENTS))
def test_delta_equals_the_per_token_reference(case: str, tiny_qwen2_dir: str) -> None:
    model, config = load_model(tiny_qwen2_dir, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    lora = model.attach_lora(num_slots=3, max_rank=8)
    adapters = [
        _adapter(config, 8, 0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        _adapter(config, 3, 1, ("v_proj", "up_proj")),
        _adapter(config, 5, 2, ("q_proj", "down_proj")),
    ]
    for slot, adapter in enumerate(adapters):
        lora.set_slot(slot, adapter)
    segments = SEGMENTS[case]
    token_slots = [slot for slot, n in segments for _ in range(n)]
    layer = model.model.layers[1]
    qkv = layer.self_attn.qkv_proj
    x = torch.randn(len(token_slots), qkv.in_features, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        base = qkv(x)
        lora.set_batch(segments, [a.rank for a in adapters])
        got = qkv(x)
        lora.clear_batch()
    expected = base.clone()
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        adapter = adapters[slot]
        for name, start, end in qkv.shard_rows():
            pair = adapter.weights.get((1, name))
            if pair is not None:
                a, b = pair
                expected[row, start:end] += adapter.scaling * (b @ (a @ x[row]))
    # The deltas are sums of rank x in_features products (values up to ~100): float32 rounding is
    # relative to that scale, not to each element.
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)
    assert not torch.equal(got, base)
