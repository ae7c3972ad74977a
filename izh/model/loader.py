"""Loading a model from a Hugging Face folder (config.json + safetensors, or an older
pytorch_model.bin read with weights_only) or a single GGUF file."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from izh.errors import ModelLoadError
from izh.model import gguf_loader, parallel
from izh.model.config import GEMMA_ARCHITECTURES, ModelConfig, hf_architecture
from izh.model.gemma import gemma_checkpoint_tensors
from izh.model.gguf_file import GGUFFile
from izh.model.idefics3 import Idefics3ForConditionalGeneration
from izh.model.llama import LlamaForCausalLM
from izh.model.packing import pack_gguf_blocks
from izh.model.parallel import TensorParallel
from izh.model.phi3 import phi3_checkpoint_tensors
from izh.model.registry import build_model, get_model_class
from izh.model.weights import CheckpointTensor, ProgressFn, load_weights

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"


def is_gguf(path: str) -> bool:
    """True for a GGUF file (by extension, or by magic bytes for an extensionless file)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def load_model_config(path: str) -> ModelConfig:
    """ModelConfig of a HF folder or GGUF file; an unsupported architecture raises ModelLoadError."""
    _check_exists(path)
    if is_gguf(path):
        with GGUFFile(path) as file:
            _check_architecture(file.metadata.get("general.architecture"))
            config = gguf_loader.gguf_model_config(file)
    else:
        hf_config = _read_hf_config(path)
        _check_architecture(hf_architecture(hf_config))
        config = ModelConfig.from_hf_config(hf_config)
    get_model_class(config.architecture)  # reject unsupported architectures here, not at load time
    return config


def _check_architecture(architecture: object) -> None:
    """An architecture izh does not serve is refused by name before its config is parsed (a parse of
    another family's metadata would fail on some missing key instead)."""
    if isinstance(architecture, str):
        get_model_class(architecture)


def checkpoint_quant_types(path: str) -> dict[str, str]:
    """transformers' name -> stored type of each tensor a GGUF file stores quantized ({} for a HF folder
    of float safetensors); reads only the file's descriptors."""
    if not is_gguf(path):
        return {}
    with GGUFFile(path) as file:
        return gguf_loader.quantized_tensor_types(file)


def load_model(
    path: str,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: ProgressFn | None = None,
    tp: TensorParallel | None = None,
    gguf_blocks: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `path` (HF folder or .gguf file) on `device` and load every weight.

    `progress(done, total, tensor_name)` is called after each tensor. Any missing, unexpected or
    mis-shaped tensor raises ModelLoadError naming it (nothing is half-loaded silently). With `tp`
    (more than one rank), the model is `tp.rank`'s shard (izh.model.parallel): built on the meta device,
    sharded, then given storage for its slices only, and each tensor is read as that slice. With
    `gguf_blocks`, a GGUF's tensors in a type izh's block kernels serve are kept in their own blocks and
    never dequantized (izh.model.packing.pack_gguf_blocks: float32, one rank).
    """
    _check_exists(path)
    start_s = time.perf_counter()
    with ExitStack() as files:
        if is_gguf(path):
            file = files.enter_context(GGUFFile(path))
            _check_architecture(file.metadata.get("general.architecture"))
            config = gguf_loader.gguf_model_config(file)
            tensors: list[CheckpointTensor] = list(gguf_loader.gguf_checkpoint_tensors(file, config))
            if config.architecture == "phi3":
                tensors = list(phi3_checkpoint_tensors(tensors, config))
        else:
            hf_config = _read_hf_config(path)
            _check_architecture(hf_architecture(hf_config))
            config = ModelConfig.from_hf_config(hf_config)
            if _pytorch_bin_only(path):
                tensors = list(_pytorch_bin_checkpoint_tensors(path))
            else:
                tensors = list(_safetensors_checkpoint_tensors(path, files))
            if config.is_encoder:
                tensors = _encoder_tensors(tensors, keep_pooler=config.architecture == "bert_classifier")
            if config.vision is not None:
                tensors = _vlm_tensors(tensors)
            if config.architecture in GEMMA_ARCHITECTURES:
                tensors = list(gemma_checkpoint_tensors(tensors))
            if config.architecture == "phi3":
                tensors = list(phi3_checkpoint_tensors(tensors, config))
            if config.architecture == "mixtral":
                tensors = _mixtral_tensors(tensors)
        get_model_class(config.architecture)
        if tp is not None and tp.world_size > 1:
            parallel.check_tensor_parallel(config, tp.world_size)
            with torch.device("meta"):
                model = build_model(config, dtype=dtype)
                parallel.shard_model(cast(LlamaForCausalLM, model), tp)
            parallel.materialize(model, device)
        else:
            with torch.device(device):
                model = build_model(config, dtype=dtype)
        served: set[str] = set()
        if gguf_blocks and is_gguf(path) and (tp is None or tp.world_size == 1):
            served = pack_gguf_blocks(cast(LlamaForCausalLM, model), file, config)
        load_weights(
            model,
            tensors,
            tied_embeddings=config.tie_word_embeddings,
            progress=progress,
            already_loaded=served,
        )
    model.eval()
    logger.info(
        "loaded %s (%s, %d layers) as %s on %s in %.2f s",
        path,
        config.architecture,
        config.num_hidden_layers,
        dtype,
        device,
        time.perf_counter() - start_s,
    )
    return model, config


_ENCODER_UNUSED = ("cls.", "embeddings.position_ids", "embeddings.token_type_ids")
"""BERT checkpoint tensors izh does not use: the pre-training heads, and saved position-ids and
token-type-ids buffers; and the [CLS] pooler, unless a classifier reads it (embeddings pool their own
way, izh.model.pooling)."""


def _encoder_tensors(tensors: list[CheckpointTensor], *, keep_pooler: bool) -> list[CheckpointTensor]:
    """A BERT (or XLM-RoBERTa) checkpoint under BertModel's names: a `bert.` (`roberta.`) prefix
    stripped, unused tensors skipped (the pooler too unless `keep_pooler`: BertForSequenceClassification)."""
    kept = []
    for t in tensors:
        name = t.name.removeprefix("bert.").removeprefix("roberta.")
        if name.startswith(_ENCODER_UNUSED) or (not keep_pooler and name.startswith("pooler.")):
            continue
        kept.append(CheckpointTensor(name=name, shape=t.shape, source=t.source, read=t.read))
    return kept


def _vlm_tensors(tensors: list[CheckpointTensor]) -> list[CheckpointTensor]:
    """An Idefics3 checkpoint under the model's names (`model.text_model.` -> `model.`, ...); a name
    outside its prefixes is kept as is, for load_weights to report as unexpected."""
    renamed = []
    for t in tensors:
        name = Idefics3ForConditionalGeneration.checkpoint_name(t.name) or t.name
        renamed.append(CheckpointTensor(name=name, shape=t.shape, source=t.source, read=t.read))
    return renamed


_MIXTRAL_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def _mixtral_tensors(tensors: list[CheckpointTensor]) -> list[CheckpointTensor]:
    """A Mixtral checkpoint under izh's MoE names (izh.model.moe): `block_sparse_moe.` -> `mlp.`, the
    experts' w1 / w3 / w2 -> gate_proj / up_proj / down_proj (transformers renames them the same way)."""
    renamed = []
    for t in tensors:
        name = t.name
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_RENAMES:
                name = name.replace(old, new)
        renamed.append(replace(t, name=name))
    return renamed


def _check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path} does not exist")


def _read_hf_config(folder: str) -> dict[str, Any]:
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} is neither a GGUF file nor a folder with a config.json")
    try:
        with config_path.open() as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_path}: {e}") from e


def _safetensors_files(folder: str) -> list[Path]:
    root = Path(folder)
    index = root / _SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"weight shard {f} (listed in {_SAFETENSORS_INDEX}) is missing")
    return files


_PYTORCH_BIN = "pytorch_model.bin"


def _pytorch_bin_only(folder: str) -> bool:
    """A folder with transformers' older single-file pickle checkpoint and no safetensors (many
    sentence-transformers models on the Hub)."""
    root = Path(folder)
    return (
        (root / _PYTORCH_BIN).is_file()
        and not (root / _SAFETENSORS_INDEX).is_file()
        and not any(root.glob("*.safetensors"))
    )


def _pytorch_bin_checkpoint_tensors(folder: str) -> Iterator[CheckpointTensor]:
    """The tensors of pytorch_model.bin, read with `weights_only=True` (tensors and plain containers
    only: a pickle that would run code is refused) and memory-mapped."""
    file = Path(folder) / _PYTORCH_BIN
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # an unpicklable or malicious file, a truncated one
        raise ModelLoadError(f"cannot read {file} (as weights only): {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{file} does not hold a state dict of tensors")
    for name, tensor in state.items():
        yield CheckpointTensor(name=name, shape=tuple(tensor.shape), source=file.name, read=_constant(tensor))


def _constant(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def _safetensors_checkpoint_tensors(folder: str, files: ExitStack) -> Iterator[CheckpointTensor]:
    """Tensors of every shard; the shards stay open (memory-mapped) until `files` closes."""
    for file in _safetensors_files(folder):
        try:
            handle = files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            entries = [(name, tuple(handle.get_slice(name).get_shape())) for name in handle.keys()]  # noqa: SIM118
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"cannot read {file}: {e}") from e
        for name, shape in entries:
            yield CheckpointTensor(
                name=name,
                shape=shape,
                source=file.name,
                read=_tensor_reader(handle, name),
                read_slice=_slice_reader(handle, name),
            )


def _tensor_reader(handle: Any, name: str) -> Callable[[], torch.Tensor]:
    return lambda: handle.get_tensor(name)


def _slice_reader(handle: Any, name: str) -> Callable[[int, int, int], torch.Tensor]:
    """(dim, start, end) -> that slice only, read from the memory-mapped file (safetensors' get_slice)."""

    def read(dim: int, start: int, end: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, end),)
        return handle.get_slice(name)[index]

    return read
