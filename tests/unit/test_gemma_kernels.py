"""Gemma's C kernels (izh.kernels.cpu.gemma) on every variant this CPU runs against their torch references:
GELU(tanh) * up, and the in-place RMSNorm of each q/k head of a packed qkv."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import izh.kernels.cpu as K
from izh.kernels.cpu.gemma import gelu_tanh_mul, gelu_tanh_mul_ref, rms_norm_heads_, rms_norm_heads_ref_

BF16 = torch.bfloat16
DTYPES = [torch.float32, BF16]
VARIANTS_HERE = K.runnable_variants() if K.available() else []
_NO_VARIANT = pytest.param(None, marks=pytest.mark.skip(reason="C kernels unavailable here"))


@pytest.fixture(params=VARIANTS_HERE or [_NO_VARIANT], autouse=True)
def each_variant(request: pytest.FixtureRequest) -> Iterator[str]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the larger cases take the OpenMP paths
    with K.use_variant(request.param):
        yield request.param
    torch.set_num_threads(before)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def test_gelu_tanh_mul_ref_is_transformers_geglu() -> None:
    gu = _randn(3, 64, dtype=torch.float32, seed=1, scale=3.0)
    gate, up = gu[:, :32], gu[:, 32:]
    expected = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(gelu_tanh_mul_ref(gu), expected)
    assert torch.equal(gelu_tanh_mul_ref(gu), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 300])
def test_gelu_tanh_mul(dtype: torch.dtype, n: int) -> None:
    inter = 2048 if n < 300 else 96
    gu = _randn(n, 2 * inter, dtype=dtype, seed=n, scale=4.0)
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-4, -1e-4, 30.0, -30.0, 200.0, -200.0], dtype=dtype)
    out, ref = gelu_tanh_mul(gu), gelu_tanh_mul_ref(gu)
    assert out.shape == (n, inter) and out.is_contiguous()
    # torch's float32 tanh formula cancels where tanh nears -1 (gate << 0): against float64 the kernel is
    # within a few ulps everywhere (bf16: two roundings, the gelu's and the product's), and within torch's
    # own error of torch
    exact = gelu_tanh_mul_ref(gu.double()).float()
    rtol = 2**-7 if dtype == BF16 else 4e-6
    torch.testing.assert_close(out.float(), exact, rtol=rtol, atol=1e-12)
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=4e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 200])
def test_rms_norm_heads_on_the_q_and_k_of_a_qkv(dtype: torch.dtype, n: int) -> None:
    heads, kv_heads, d = 4, 1, 256
    qkv = _randn(n, (heads + 2 * kv_heads) * d, dtype=dtype, seed=n, scale=3.0).view(n, -1, d)
    qw, kw = _randn(d, dtype=dtype, seed=2), _randn(d, dtype=dtype, seed=3)
    ref = qkv.clone()
    original = qkv.clone()
    rms_norm_heads_(qkv[:, :heads], qw, 1e-6)
    rms_norm_heads_(qkv[:, heads : heads + kv_heads], kw, 1e-6)
    rms_norm_heads_ref_(ref[:, :heads], qw, 1e-6)
    rms_norm_heads_ref_(ref[:, heads : heads + kv_heads], kw, 1e-6)
    assert torch.equal(qkv[:, heads + kv_heads :], original[:, heads + kv_heads :])  # V untouched
    if dtype == torch.float32:
        # each head exactly as the row kernel normalizes a row
        rows = K.rms_norm(original[:, :heads].reshape(-1, d), qw, 1e-6)
        assert torch.equal(qkv[:, :heads].reshape(-1, d), rows)
        torch.testing.assert_close(qkv, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(qkv.float(), ref.float(), rtol=2**-7, atol=1e-6)
