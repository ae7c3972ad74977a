"""Embeddings from final hidden states: the model's pooling spec (from its files) and the pooling step.

`resolve_pooling` reads what a Hugging Face folder declares: sentence-transformers' modules.json
(a Normalize module), 1_Pooling/config.json (the pooling mode) and sentence_bert_config.json
(max_seq_length), and config.json's Matryoshka fields (`matryoshka_dimensions`, `is_matryoshka`), then
applies the `model.pooling` / `model.normalize_embeddings` settings over them. Without such files a
decoder pools its last token, normalized (vLLM's default), and an encoder its first ([CLS]) token.

`pool` turns a step's flat hidden states into one float32 vector per pooling request: mean, cls or
last over the request's rows, truncated to `dimensions`, then L2-normalized when asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from izh.errors import ModelLoadError
from izh.pooling_params import POOLING_TYPES, PoolingParams

_ST_MODULE_PREFIX = "sentence_transformers.models."
_ST_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """A model's embedding defaults (what Ready tells the API)."""

    pooling_type: str
    normalize: bool
    matryoshka_dimensions: list[int] | None
    """None: `dimensions` is refused; []: any size up to the hidden size; else those sizes."""
    max_seq_length: int | None
    """sentence-transformers' max_seq_length, when the folder says (the default max_model_len)."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _st_modules(folder: Path) -> list[dict[str, Any]] | None:
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{path} is not a list of modules")
    return [m for m in modules if isinstance(m, dict)]


def _st_pooling_type(folder: Path, modules: list[dict[str, Any]]) -> str | None:
    """The pooling a sentence-transformers folder declares; ModelLoadError for modules or modes izh
    does not implement (an embedding that silently differs from the model's would be worse)."""
    pooling_type = None
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_MODULE_PREFIX)
        if kind not in _ST_SUPPORTED_MODULES:
            raise ModelLoadError(
                f"{folder}/modules.json has a {module.get('type')!r} module; izh implements only "
                f"{', '.join(_ST_SUPPORTED_MODULES)}"
            )
        if kind != "Pooling":
            continue
        config = _read_json(folder / str(module.get("path", "")) / "config.json")
        mode = config.get("pooling_mode")
        if isinstance(mode, str):
            mode = {"lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls"}.get(mode, mode)
            if mode not in POOLING_TYPES:
                raise ModelLoadError(f"pooling mode {mode!r} is not supported ({', '.join(POOLING_TYPES)})")
            pooling_type = mode
            continue
        unsupported = [k for k in _ST_UNSUPPORTED_MODES if config.get(k)]
        chosen = [v for k, v in _ST_POOLING_MODES.items() if config.get(k)]
        if unsupported or len(chosen) != 1:
            raise ModelLoadError(
                f"{folder}/{module.get('path')}/config.json asks for pooling "
                f"{', '.join(unsupported + chosen) or 'none'}; izh supports exactly one of mean, cls, last"
            )
        pooling_type = chosen[0]
    return pooling_type


def resolve_pooling(
    model_path: str, *, is_encoder: bool, pooling: str = "auto", normalize: bool | None = None
) -> PoolingConfig:
    """The pooling spec of the model at `model_path` (a folder or a GGUF file), with the settings'
    `pooling` ("auto" or a POOLING_TYPES value) and `normalize` (None: the model's) over it."""
    if pooling != "auto" and pooling not in POOLING_TYPES:
        raise ModelLoadError(
            f"model.pooling must be auto or one of {', '.join(POOLING_TYPES)}, got {pooling!r}"
        )
    folder = Path(model_path)
    model_pooling: str | None = None
    model_normalize = not is_encoder
    matryoshka: list[int] | None = None
    max_seq_length = None
    if folder.is_dir():
        modules = _st_modules(folder)
        if modules is not None:
            model_pooling = _st_pooling_type(folder, modules)
            model_normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        st_config = folder / "sentence_bert_config.json"
        if st_config.is_file():
            value = _read_json(st_config).get("max_seq_length")
            max_seq_length = int(value) if isinstance(value, int) and value > 0 else None
        hf_config = folder / "config.json"
        if hf_config.is_file():
            config = _read_json(hf_config)
            dims = config.get("matryoshka_dimensions")
            if isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims):
                matryoshka = sorted(dims)
            elif config.get("is_matryoshka"):
                matryoshka = []
    if model_pooling is None:
        model_pooling = "cls" if is_encoder else "last"
    return PoolingConfig(
        pooling_type=model_pooling if pooling == "auto" else pooling,
        normalize=model_normalize if normalize is None else normalize,
        matryoshka_dimensions=matryoshka,
        max_seq_length=max_seq_length,
    )


def pool(hidden: Tensor, spans: list[tuple[int, int]], params: list[PoolingParams]) -> list[bytes]:
    """One little-endian float32 vector per request: rows [start, end) of `hidden` [num_tokens, H]
    pooled by `params[i]` (mean, cls = first row, last = last row), truncated, normalized."""
    device = hidden.device
    starts = torch.tensor([s for s, _ in spans], dtype=torch.long, device=device)
    ends = torch.tensor([e for _, e in spans], dtype=torch.long, device=device)
    pooled = torch.empty((len(spans), hidden.shape[1]), dtype=torch.float32, device=device)
    kinds = [p.pooling_type for p in params]
    for kind in set(kinds):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        index = torch.tensor(rows, dtype=torch.long, device=device)
        if kind == "cls":
            pooled[index] = hidden.index_select(0, starts[index]).float()
        elif kind == "last":
            pooled[index] = hidden.index_select(0, ends[index] - 1).float()
        else:
            lengths = [spans[i][1] - spans[i][0] for i in rows]
            token_rows = torch.cat([torch.arange(spans[i][0], spans[i][1], device=device) for i in rows])
            segment = torch.repeat_interleave(
                torch.arange(len(rows), device=device), torch.tensor(lengths, device=device)
            )
            sums = torch.zeros((len(rows), hidden.shape[1]), dtype=torch.float32, device=device)
            sums.index_add_(0, segment, hidden.index_select(0, token_rows).float())
            pooled[index] = sums / torch.tensor(lengths, dtype=torch.float32, device=device).unsqueeze(1)
    vectors = pooled.cpu()
    out = []
    for i, p in enumerate(params):
        vector = vectors[i, : p.dimensions] if p.dimensions is not None else vectors[i]
        if p.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
        out.append(vector.numpy().astype("<f4", copy=False).tobytes())
    return out
