"""The Triton paged-attention kernels against their torch references, on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, and setting it for the whole test session
would turn the GPU tests into interpreter runs, so the Triton tests run in a subprocess (this file again,
with TRITON_INTERPRET=1); the reference checks run in the session itself.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.paged_attention_cases import (
    MIXED,
    make_batch,
    reference_float64,
    relative_error,
    run_reference,
    run_triton,
)
from izh.kernels.paged_attention import write_kv_cache, write_kv_cache_reference

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
interpreter_only = pytest.mark.skipif(
    not (IN_INTERPRETER and HAS_TRITON), reason="runs in the TRITON_INTERPRET=1 subprocess"
)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3}


# --- the references, in the session ---------------------------------------------------------------


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 1), (3, 3)])
def test_reference_matches_dense_causal_sdpa(num_heads: int, num_kv_heads: int) -> None:
    b = make_batch(MIXED, num_heads, num_kv_heads, head_dim=16, block_size=8, dtype=torch.float32)
    scale = 0.25
    out = run_reference(b, scale)
    assert torch.isfinite(out).all()
    starts = b.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(b.keys, b.values, strict=True)):
        seq_len, query_len = k.shape[0], starts[i + 1] - starts[i]
        # The dense view: the whole sequence, its last query_len rows being this step's queries.
        q = torch.zeros(seq_len, num_heads, 16)
        q[seq_len - query_len :] = b.q[starts[i] : starts[i + 1]]
        dense = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], dense[seq_len - query_len :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float64_reference_matches_the_paged_reference(dtype: torch.dtype) -> None:
    """benchmarks.paged_attention_cases.reference_float64 (dense K/V, float64), the GPU check's yardstick,
    against paged_attention_reference (through the cache, float32)."""
    b = make_batch(MIXED, 4, 2, head_dim=16, block_size=8, dtype=dtype, seed=5)
    ref64 = reference_float64(b, 0.25)
    assert relative_error(run_reference(b, 0.25), ref64) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_write_kv_cache_reference_skips_negative_slots() -> None:
    kv_cache = torch.zeros(2, 3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_cache_reference(key, value, kv_cache, torch.tensor([5, -1, 11]))
    torch.testing.assert_close(kv_cache[0, 1, 1], key[0])  # slot 5 = block 1, offset 1
    torch.testing.assert_close(kv_cache[1, 2, 3], value[2])  # slot 11 = block 2, offset 3
    assert kv_cache.count_nonzero() == 2 * 2 * 2 * 8  # two tokens, K and V each: nothing else written


@pytest.mark.skipif(IN_INTERPRETER or not HAS_TRITON, reason="needs triton; runs the subprocess itself")
def test_kernels_under_interpreter_subprocess() -> None:
    """Run this file's interpreter tests in a fresh process with TRITON_INTERPRET=1."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", str(Path(__file__))],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]


# --- the Triton kernels, in the subprocess ---------------------------------------------------------


@interpreter_only
# No bf16 here: the interpreter's tl.dot computes garbage on bf16 operands (a 16x16 product is off by
# ~1e10), so the bf16 attention kernel is checked by tests/gpu only; bf16 loads/stores work (see below).
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "dtype"),
    [
        (4, 2, 16, torch.float32),
        (4, 2, 8, torch.float32),
        (4, 1, 16, torch.float32),
        (4, 1, 8, torch.float32),
        (4, 2, 16, torch.float16),
        (4, 1, 8, torch.float16),
    ],
    ids=str,
)
def test_triton_mixed_batch_matches_reference(
    num_heads: int, num_kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    b = make_batch(MIXED, num_heads, num_kv_heads, head_dim=16, block_size=block_size, dtype=dtype)
    out = run_triton(b, 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), run_reference(b, 0.25).float(), atol=TOLERANCE[dtype], rtol=0)


@interpreter_only
@pytest.mark.parametrize("num_segments", [2, 4])
def test_triton_split_context_matches_reference(num_segments: int) -> None:
    """The split path: segments (some empty for short contexts) merged by the second kernel."""
    b = make_batch(MIXED, 4, 2, head_dim=16, block_size=16, dtype=torch.float32, seed=1)
    out = run_triton(b, 0.25, num_segments=num_segments)
    torch.testing.assert_close(out, run_reference(b, 0.25), atol=1e-4, rtol=0)


@interpreter_only
def test_triton_decode_only_batch_matches_reference() -> None:
    """max_query_len 1 picks the decode block shape; the second and third decodes share a program row."""
    lens = [(1, 70), (1, 1), (1, 17), (1, 40)]
    b = make_batch(lens, 4, 2, head_dim=16, block_size=16, dtype=torch.float32, seed=2)
    torch.testing.assert_close(run_triton(b, 0.3), run_reference(b, 0.3), atol=1e-4, rtol=0)
    torch.testing.assert_close(run_triton(b, 0.3, num_segments=4), run_reference(b, 0.3), atol=1e-4, rtol=0)


@interpreter_only
def test_triton_odd_group_and_head_dim_with_strided_query() -> None:
    """GQA 6:2 (a group of 3 leaves rows of a block unused), head_dim 24 (padded to 32), q a strided view of
    a fused qkv tensor, and the result written into a caller's `out`."""
    b = make_batch(MIXED, 6, 2, head_dim=24, block_size=8, dtype=torch.float32, seed=3)
    qkv = torch.randn(b.q.shape[0], 6 + 2 * 2, 24)
    qkv[:, :6] = b.q
    q = qkv[:, :6]
    assert not q.is_contiguous()
    out = torch.full_like(b.q, float("nan"))
    result = run_triton(b, 0.2, q=q, out=out)
    assert result is out
    torch.testing.assert_close(out, run_reference(b, 0.2), atol=1e-4, rtol=0)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    kv_cache = torch.randn(2, 5, 8, 2, 16, generator=gen).to(dtype)
    qkv = torch.randn(6, 4 + 2 * 2, 16, generator=gen).to(dtype)
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views, as sliced out of a fused projection
    slot_mapping = torch.tensor([3, 17, -1, 39, 8, -1])
    expected = kv_cache.clone()
    write_kv_cache_reference(key, value, expected, slot_mapping)
    write_kv_cache(key, value, kv_cache, slot_mapping)
    assert torch.equal(kv_cache, expected)
