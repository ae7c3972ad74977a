"""The engine on the Triton attention backend gives the torch backend's tokens.

Without a GPU, Triton's CPU interpreter runs the same kernels (TRITON_INTERPRET=1, set before triton is
imported, hence a subprocess). On CUDA machines, tests/gpu covers the compiled kernels and CUDA graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from izh import LLM, SamplingParams
path = sys.argv[1]
prompts = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "a"]
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
result = {}
for backend in ("torch_paged", "triton_paged"):
    # A small token budget: chunked prefills and decodes share steps (mixed batches).
    llm = LLM(path, attention_backend=backend, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=12)
    assert llm.engine_core.runner.model.paged_backend.name == backend
    result[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
print(json.dumps(result))
"""


def test_triton_backend_matches_torch_backend_under_the_interpreter(tiny_llama_dir: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_llama_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["triton_paged"] == result["torch_paged"]
    assert all(len(tokens) == 6 for tokens in result["torch_paged"])
