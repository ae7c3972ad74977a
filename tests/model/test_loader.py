"""Loading HF folders: every tensor lands where it belongs, and a bad checkpoint fails naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from izh.errors import ModelLoadError, UnsupportedModel
from izh.model import ModelConfig, load_model, load_model_config
from izh.model.registry import MODEL_REGISTRY, get_model_class

SUPPORTED = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(folder: Path, edit) -> None:  # edit(dict) mutates the tensors of model.safetensors
    file = folder / "model.safetensors"
    weights = load_file(str(file))
    edit(weights)
    save_file(weights, str(file), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_every_parameter_equals_its_checkpoint_tensor(tiny_qwen2_dir: str) -> None:
    # qwen2 is the sharded one: two files and an index.
    assert (Path(tiny_qwen2_dir) / "model.safetensors.index.json").is_file()
    ckpt = {}
    for f in sorted(Path(tiny_qwen2_dir).glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    model, _ = load_model(tiny_qwen2_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    attn = "model.layers.1.self_attn."
    qkv = torch.cat([ckpt[f"{attn}{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params[f"{attn}qkv_proj.weight"], qkv)
    assert torch.equal(
        params[f"{attn}qkv_proj.bias"], torch.cat([ckpt[f"{attn}{p}_proj.bias"] for p in "qkv"])
    )
    assert f"{attn}o_proj.bias" not in params  # Qwen2: biases on q/k/v only
    mlp = "model.layers.2.mlp."
    gate_up = torch.cat([ckpt[f"{mlp}gate_proj.weight"], ckpt[f"{mlp}up_proj.weight"]])
    assert torch.equal(params[f"{mlp}gate_up_proj.weight"], gate_up)
    assert torch.equal(params["lm_head.weight"], ckpt["lm_head.weight"])
    assert torch.equal(params["model.norm.weight"], ckpt["model.norm.weight"])
    total = sum(t.numel() for t in ckpt.values())
    assert sum(p.numel() for p in model.parameters()) == total
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def test_progress_reports_every_tensor(tiny_qwen2_dir: str) -> None:
    calls: list[tuple[int, int, str]] = []
    load_model(tiny_qwen2_dir, dtype=torch.float32, progress=lambda d, t, n: calls.append((d, t, n)))
    index = json.loads((Path(tiny_qwen2_dir) / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert [c[0] for c in calls] == list(range(1, len(names) + 1))
    assert {c[1] for c in calls} == {len(names)}
    assert {c[2] for c in calls} == names


def test_bfloat16_load(tiny_llama_dir: str) -> None:
    model, _ = load_model(tiny_llama_dir, dtype=torch.bfloat16)
    ckpt = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    got = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ckpt["model.embed_tokens.weight"].to(torch.bfloat16))
    assert model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16


def test_missing_tensor_is_named(tiny_llama_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(folder), dtype=torch.float32)


def test_unexpected_tensor_is_named(tiny_llama_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(str(folder), dtype=torch.float32)


def test_misshaped_tensor_is_named(tiny_llama_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 63)}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \[128, 63\]"):
        load_model(str(folder), dtype=torch.float32)


def test_untied_model_needs_lm_head(tiny_llama3_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_llama3_dir, tmp_path / "m")
    _edit_weights(folder, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"missing.*lm_head\.weight"):
        load_model(str(folder), dtype=torch.float32)


def test_ignorable_extras_are_ignored(tiny_llama_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")

    def add_extras(w: dict[str, torch.Tensor]) -> None:
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()  # tied: a saved copy of the head
        w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    _edit_weights(folder, add_extras)
    model, config = load_model(str(folder), dtype=torch.float32)
    assert config.tie_word_embeddings and model.lm_head is None


def test_missing_shard_is_named(tiny_qwen2_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_qwen2_dir, tmp_path / "m")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        load_model(str(folder), dtype=torch.float32)


def test_unknown_architecture_lists_supported(tiny_llama_dir: str, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(folder, architectures=["FalconForCausalLM"], model_type="falcon")
    for load in (load_model_config, lambda p: load_model(p, dtype=torch.float32)):
        with pytest.raises(UnsupportedModel, match=f"FalconForCausalLM.*{SUPPORTED}"):
            load(str(folder))
    with pytest.raises(ModelLoadError, match=r"supported: .*qwen3"):
        get_model_class("falcon")
    assert set(MODEL_REGISTRY) >= {"llama", "qwen2", "qwen3"}


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path), dtype=torch.float32)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model_config(str(bad))


def _hf_dict(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    base.update(changes)
    return base


def test_config_from_hf_variants() -> None:
    c = ModelConfig.from_hf_config(_hf_dict())
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta, c.rope_scaling) == (4, 8, 10000.0, None)
    assert not c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    # transformers 5 writes rope settings under rope_parameters
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    c = ModelConfig.from_hf_config(_hf_dict(rope_parameters=llama3))
    assert c.rope_theta == 500000.0
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in c.rope_scaling
    c = ModelConfig.from_hf_config(_hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (c.rope_theta, c.rope_scaling) == (1e6, None)
    # older configs say "type"
    c = ModelConfig.from_hf_config(_hf_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    c = ModelConfig.from_hf_config(_hf_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert c.architecture == "qwen2" and c.attention_bias


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "dynamic.*supported: default, linear, llama3",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "yarn.* lacks original_max_position_embeddings",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_config_rejects_unsupported(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_config(_hf_dict(**changes))


def test_config_names_a_missing_field() -> None:
    d = _hf_dict()
    d.pop("vocab_size")
    with pytest.raises(ModelLoadError, match="vocab_size"):
        ModelConfig.from_hf_config(d)
