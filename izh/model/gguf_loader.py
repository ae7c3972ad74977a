"""GGUF models: ModelConfig from metadata, tensor names mapped to transformers' names, tensors
dequantized one at a time with `gguf.quants.dequantize` (Llama q/k rows un-permuted)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import gguf
import numpy as np
import torch
from torch import Tensor

from izh.errors import ModelLoadError
from izh.kernels.cpu.gguf_blocks import GGUF_BLOCK_TYPES
from izh.model.config import ModelConfig, with_gguf_longrope
from izh.model.gguf_file import GGUFFile, GGUFTensorInfo
from izh.model.weights import CheckpointTensor

# Architectures whose attn_q / attn_k rows llama.cpp's convert_hf_to_gguf permutes for its RoPE layout.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mixtral"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts router
}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the pre-feedforward norm there.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: fused q/k/v, and ffn_up holding gate and up (split by izh.model.phi3 after renaming).
_PHI3_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_ARCH_BLOCK_NAMES = {"gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES, "phi3": _PHI3_BLOCK_NAMES}
# A mixture of experts' 3-D tensors [num_experts, out, in]: one transformers tensor per expert.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS_TENSOR = "rope_freqs.weight"
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
"""LongRoPE's per-frequency factors (Phi-3), folded into ModelConfig.rope_scaling."""
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


_DEQUANTIZED_TYPES = frozenset(
    {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0"}
)
"""Quantized types without a block kernel: dequantized at load (gguf-py) and packed as int8 records."""
SERVED_TYPES = _FLOAT_TYPES | frozenset(GGUF_BLOCK_TYPES) | _DEQUANTIZED_TYPES


def check_servable(file: GGUFFile) -> None:
    """ModelLoadError naming the first weight tensor whose type izh cannot serve, and the type."""
    for t in file.tensors:
        if t.ggml_type.name not in SERVED_TYPES:
            raise ModelLoadError(
                f"GGUF tensor {t.name} has type {t.ggml_type.name}, which izh cannot serve "
                f"(served: {', '.join(sorted(SERVED_TYPES))})"
            )


def gguf_model_config(file: GGUFFile) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata and tensor descriptors (every tensor's type checked)."""
    check_servable(file)
    shapes = {t.name: t.shape for t in file.tensors}
    freq_factors = None
    longrope: dict[str, list[float]] = {}
    for t in file.tensors:
        if t.name == ROPE_FREQS_TENSOR:
            freq_factors = dequantize(file, t).reshape(-1).tolist()
        elif t.name in LONGROPE_TENSORS:
            key = "short_factor" if t.name == LONGROPE_TENSORS[0] else "long_factor"
            longrope[key] = dequantize(file, t).reshape(-1).tolist()
    config = ModelConfig.from_gguf_metadata(file.metadata, shapes, rope_freq_factors=freq_factors)
    if len(longrope) == 2:
        config = with_gguf_longrope(config, file.metadata, longrope)
    return config


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """transformers' checkpoint name for a GGUF tensor name of `architecture`; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block_names = _ARCH_BLOCK_NAMES.get(architecture, _BLOCK_NAMES)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in block_names:
        return None
    return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"


def expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """transformers' per-expert names of a GGUF expert tensor (`blk.N.ffn_gate_exps.weight` ->
    `model.layers.N.mlp.experts.E.gate_proj.weight` for E in order); None for any other tensor."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _EXPERT_NAMES:
        return None
    projection = _EXPERT_NAMES[m.group(2)]
    return [
        f"model.layers.{m.group(1)}.mlp.experts.{e}.{projection}.{m.group(3)}" for e in range(num_experts)
    ]


def dequantize_expert(file: GGUFFile, info: GGUFTensorInfo, expert: int) -> Tensor:
    """Expert `expert`'s [out, in] matrix of a 3-D expert tensor, dequantizing only its bytes."""
    _, out_features, in_features = info.shape
    raw = np.ascontiguousarray(file.raw(info)[expert])
    return _to_tensor(_dequantize(raw, info, (out_features, in_features), 0))


def dequantize(file: GGUFFile, info: GGUFTensorInfo, *, unpermute_heads: int = 0) -> Tensor:
    """One tensor as float32 in torch's shape (a fresh tensor, never a view of the file); Llama q/k
    rows un-permuted over `unpermute_heads` heads when non-zero."""
    return _to_tensor(_dequantize(file.raw(info), info, info.shape, unpermute_heads))


def _dequantize(
    raw: np.ndarray, info: GGUFTensorInfo, shape: tuple[int, ...], unpermute_heads: int
) -> np.ndarray:
    try:
        array = gguf.quants.dequantize(raw, info.ggml_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"GGUF tensor {info.name}: {e}") from e
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if unpermute_heads:
        array = unpermute_qk(array, unpermute_heads)
    return array


def _to_tensor(array: np.ndarray) -> Tensor:
    # numpy, not torch, for these copies: single-threaded, so cheap even on a busy machine.
    return torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable else array.copy())


def dequantize_slice(
    file: GGUFFile, info: GGUFTensorInfo, dim: int, start: int, end: int, *, unpermute_heads: int = 0
) -> Tensor:
    """Only [start, end) along `dim` of a tensor, as float32 (a tensor-parallel shard), dequantizing only
    those bytes where the quantization allows: rows are independent (dim 0), and a column range is cut at
    quantization-block boundaries (dim 1); a column range inside a block dequantizes the whole tensor
    and cuts it. Llama q/k rows (whole heads) are un-permuted per head."""
    raw = file.raw(info)
    shape = list(info.shape)
    if dim == 0 and len(shape) == 2:
        heads = unpermute_heads * (end - start) // shape[0] if unpermute_heads else 0
        shape[0] = end - start
        return _to_tensor(_dequantize(np.ascontiguousarray(raw[start:end]), info, tuple(shape), heads))
    block_size, type_size = gguf.GGML_QUANT_SIZES[info.ggml_type]
    last = len(shape) - 1
    if dim == last and not unpermute_heads and start % block_size == 0 and end % block_size == 0:
        cut = raw[..., start // block_size * type_size : end // block_size * type_size]
        shape[last] = end - start
        return _to_tensor(_dequantize(np.ascontiguousarray(cut), info, tuple(shape), 0))
    full = _dequantize(raw, info, info.shape, unpermute_heads)
    index = (slice(None),) * dim + (slice(start, end),)
    return _to_tensor(np.ascontiguousarray(full[index]))


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: interleaved halves back to rotate-half order).

    The converter maps each head's rows [first half, second half] to [h0[0], h1[0], h0[1], h1[1], ...];
    this is its inverse. Works for weights [rows, in] and biases [rows]; returns a new array.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ModelLoadError(f"cannot un-permute {rows} rows over {num_heads} heads")
    rest = weight.shape[1:]
    halves = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(halves).reshape(weight.shape)


def quantized_tensor_types(file: GGUFFile) -> dict[str, str]:
    """transformers' name -> GGUF type name (e.g. "Q4_1") of every tensor stored quantized."""
    types = {}
    architecture = str(file.metadata.get("general.architecture", "llama"))
    for t in file.tensors:
        if t.ggml_type.name not in _FLOAT_TYPES and len(t.shape) == 3:
            types.update(dict.fromkeys(expert_names(t.name, t.shape[0]) or [], t.ggml_type.name))
        name = hf_name(t.name, architecture)
        if name is not None and t.ggml_type.name not in _FLOAT_TYPES:
            types[name] = t.ggml_type.name
    return types


def gguf_checkpoint_tensors(file: GGUFFile, config: ModelConfig) -> Iterator[CheckpointTensor]:
    """The file's weight tensors under transformers' names, each dequantized (and, for Llama q/k,
    un-permuted) only when read. An unknown GGUF tensor keeps its GGUF name (the loader rejects it)."""
    permuted = config.architecture in _PERMUTED_QK_ARCHITECTURES
    for t in file.tensors:
        if t.name == ROPE_FREQS_TENSOR or t.name in LONGROPE_TENSORS:
            continue  # folded into ModelConfig.rope_scaling
        experts = expert_names(t.name, t.shape[0]) if len(t.shape) == 3 else None
        if experts is not None:
            yield from _expert_tensors(file, t, experts)
            continue
        name = hf_name(t.name, config.architecture)
        heads = 0
        if permuted and name is not None:
            if ".self_attn.q_proj." in name:
                heads = config.num_attention_heads
            elif ".self_attn.k_proj." in name:
                heads = config.num_key_value_heads
        yield CheckpointTensor(
            name=name if name is not None else t.name,
            shape=t.shape,
            source=f"GGUF tensor {t.name}",
            read=_reader(file, t, heads),
            read_slice=_slice_reader(file, t, heads),
        )


def block_weights(file: GGUFFile, config: ModelConfig, names: set[str]) -> dict[str, tuple[str, Tensor]]:
    """transformers' name -> (GGUF type, a copy of its blocks uint8 [rows, row_bytes]) for each 2-D tensor
    of `names` stored in a type izh's block kernels serve (izh.kernels.cpu.gguf_blocks), and for each
    expert of a 3-D expert tensor (`ffn_*_exps`, one weight per expert), Llama q/k rows un-permuted (rows
    are whole blocks, so that is a reordering of rows)."""
    permuted = config.architecture in _PERMUTED_QK_ARCHITECTURES
    found = {}
    for t in file.tensors:
        experts = expert_names(t.name, t.shape[0]) if len(t.shape) == 3 else None
        if experts is not None and t.ggml_type.name in GGUF_BLOCK_TYPES:
            # A 3-D expert tensor [experts, rows, row_bytes]: each expert's rows are its own 2-D weight.
            raw = file.raw(t)
            for expert, expert_name in enumerate(experts):
                if expert_name in names:
                    found[expert_name] = (t.ggml_type.name, torch.from_numpy(np.array(raw[expert])))
            continue
        name = hf_name(t.name, config.architecture)
        if name is None or name not in names or len(t.shape) != 2 or t.ggml_type.name not in GGUF_BLOCK_TYPES:
            continue
        raw = file.raw(t)
        heads = 0
        if permuted and ".self_attn.q_proj." in name:
            heads = config.num_attention_heads
        elif permuted and ".self_attn.k_proj." in name:
            heads = config.num_key_value_heads
        blocks = unpermute_qk(raw, heads) if heads else np.array(raw)  # a copy: the file is closed after load
        found[name] = (t.ggml_type.name, torch.from_numpy(blocks))
    return found


def _expert_tensors(file: GGUFFile, info: GGUFTensorInfo, names: list[str]) -> Iterator[CheckpointTensor]:
    """One checkpoint tensor per expert of a 3-D expert tensor, each read alone."""
    for expert, name in enumerate(names):
        yield CheckpointTensor(
            name=name,
            shape=tuple(info.shape[1:]),
            source=f"GGUF tensor {info.name}[{expert}]",
            read=_expert_reader(file, info, expert),
        )


def _expert_reader(file: GGUFFile, info: GGUFTensorInfo, expert: int) -> Callable[[], Tensor]:
    return lambda: dequantize_expert(file, info, expert)


def _reader(file: GGUFFile, info: GGUFTensorInfo, unpermute_heads: int) -> Callable[[], Tensor]:
    return lambda: dequantize(file, info, unpermute_heads=unpermute_heads)


def _slice_reader(
    file: GGUFFile, info: GGUFTensorInfo, unpermute_heads: int
) -> Callable[[int, int, int], Tensor]:
    return lambda dim, start, end: dequantize_slice(
        file, info, dim, start, end, unpermute_heads=unpermute_heads
    )
