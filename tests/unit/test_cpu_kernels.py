"""The fused CPU kernels (izh.kernels.cpu): the torch references against plain formulas (always), the C
kernels of every variant this CPU runs against the references (when the library builds here), variant
selection, the switch, the build cache, the fallbacks, and the aarch64 cross build."""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import izh.kernels.cpu as K
from izh.errors import ModelLoadError
from izh.kernels.cpu import compiler as B
from izh.kernels.cpu import library as L

BF16 = torch.bfloat16
DTYPES = [torch.float32, BF16]
EPS = 1e-6

needs_c = pytest.mark.skipif(
    not K.available(), reason="C kernels unavailable here (IZH_CPU_KERNELS=0, no gcc, or the build failed)"
)
VARIANTS_HERE = K.runnable_variants() if K.available() else []
_NO_VARIANT = pytest.param(None, marks=pytest.mark.skip(reason="C kernels unavailable here"))


@pytest.fixture(params=VARIANTS_HERE or [_NO_VARIANT])
def each_variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every variant this CPU runs in turn, through the module-level wrappers (`use_variant`)."""
    with K.use_variant(request.param) as lib:
        assert K.variant() == request.param == lib.variant
        yield request.param


on_each_variant = pytest.mark.usefixtures("each_variant")


@pytest.fixture
def kernel_state() -> Iterator[None]:
    """Restores what `configure` and the first use set, for tests that change them."""
    state = L.STATE
    saved = (state.active, state.requested, state.kernels_dir)
    yield
    state.active, state.requested, state.kernels_dir = saved


@pytest.fixture(autouse=True)
def _two_threads() -> Iterator[None]:
    # Two threads make the larger cases take the OpenMP paths.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _r(t: Tensor) -> Tensor:
    """Round an fp32 tensor through bf16 (what a torch bf16 elementwise op does to its fp32 result)."""
    return t.to(BF16).float()


def _bf16_ulp(v: Tensor) -> Tensor:
    _, exp = torch.frexp(v.float().abs().clamp_min(1e-30))
    return torch.ldexp(torch.ones_like(v.float()), exp - 8)


def _assert_close_to_ref(out: Tensor, ref: Tensor) -> None:
    """bf16: at most one ulp apart, and at least 99% of the elements identical; fp32: allclose."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == BF16:
        diff = (out.float() - ref.float()).abs()
        ulp = _bf16_ulp(torch.maximum(out.float().abs(), ref.float().abs()))
        assert bool((diff <= ulp).all()), f"max diff {diff.max().item()}"
        assert (out == ref).float().mean().item() >= 0.99
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


# --- references against plain formulas ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_ref_formula(dtype: torch.dtype) -> None:
    x, w = _randn(5, 96, dtype=dtype, seed=1), _randn(96, dtype=dtype, seed=2)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if dtype == BF16:
        expected = _r(_r(normed) * w.float()).to(BF16)
        _assert_close_to_ref(K.rms_norm_ref(x, w, EPS), expected)
    else:
        torch.testing.assert_close(K.rms_norm_ref(x, w, EPS), normed * w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_ref_formula(dtype: torch.dtype) -> None:
    x, res, w = (
        _randn(4, 64, dtype=dtype, seed=1),
        _randn(4, 64, dtype=dtype, seed=2),
        _randn(64, dtype=dtype),
    )
    expected_res = (x.float() + res.float()).to(dtype)
    out = K.add_rms_norm_ref_(x, res, w, EPS)
    assert torch.equal(res, expected_res)
    assert torch.equal(out, K.rms_norm_ref(expected_res, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_ref_formula(dtype: torch.dtype) -> None:
    n, heads, d = 3, 4, 16
    x = _randn(n, heads, d, dtype=dtype, seed=3)
    cos_sin = _cos_sin(n, d, dtype)
    got = x.clone()
    K.rotary_ref_(got, cos_sin)
    half = d // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos_sin[:, None, :half].float(), cos_sin[:, None, half:].float()
    if dtype == BF16:  # every op rounds to bf16: the rounding the C kernel reproduces
        expected = torch.cat((_r(_r(x1 * c) - _r(x2 * s)), _r(_r(x2 * c) + _r(x1 * s))), dim=-1).to(BF16)
        assert torch.equal(got, expected)
    else:
        expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_ref_formula(dtype: torch.dtype) -> None:
    gu = _randn(3, 2 * 40, dtype=dtype, seed=4, scale=3.0)
    g, u = gu[:, :40].float(), gu[:, 40:].float()
    silu = g / (1 + torch.exp(-g))
    if dtype == BF16:
        _assert_close_to_ref(K.silu_mul_ref(gu), _r(_r(silu) * u).to(BF16))
    else:
        torch.testing.assert_close(K.silu_mul_ref(gu), silu * u)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_ref_matches_sdpa(dtype: torch.dtype) -> None:
    case = _AttentionCase(dtype, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seq_lens=[1, 6, 9])
    out = K.paged_decode_attention_ref(*case.args())
    case.check_cache()
    _assert_attention(out, case.expected_sdpa(), dtype)


# --- C kernels against the references -------------------------------------------------------------------


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 4096])
def test_rms_norm(dtype: torch.dtype, n: int) -> None:
    x, w = _randn(n, 576, dtype=dtype, seed=n, scale=2.0), _randn(576, dtype=dtype, seed=7)
    _assert_close_to_ref(K.rms_norm(x, w, EPS), K.rms_norm_ref(x, w, EPS))


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 5, 8, 100, 576, 2048, 5000])
def test_rms_norm_is_bit_identical(dtype: torch.dtype, hidden: int) -> None:
    # The row sum reproduces the order of torch's CPU sum kernel; a torch that sums differently fails here
    # (the results would then differ in rare elements by an ulp or two).
    x, w = _randn(33, hidden, dtype=dtype, seed=hidden, scale=2.0), _randn(hidden, dtype=dtype, seed=1)
    assert torch.equal(K.rms_norm(x, w, EPS), K.rms_norm_ref(x, w, EPS))


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows(dtype: torch.dtype) -> None:
    wide = _randn(7, 3 * 64, dtype=dtype, seed=5)
    x = wide[:, 64:128]  # row stride 192
    w = _randn(64, dtype=dtype, seed=6)
    out = K.rms_norm(x, w, 1e-5)
    assert out.is_contiguous()
    _assert_close_to_ref(out, K.rms_norm_ref(x, w, 1e-5))


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 4096])
def test_add_rms_norm(dtype: torch.dtype, n: int) -> None:
    x, w = _randn(n, 576, dtype=dtype, seed=n), _randn(576, dtype=dtype, seed=9)
    res_c = _randn(n, 576, dtype=dtype, seed=n + 1)
    res_ref = res_c.clone()
    out = K.add_rms_norm_(x, res_c, w, EPS)
    ref = K.add_rms_norm_ref_(x, res_ref, w, EPS)
    assert torch.equal(res_c, res_ref)  # the residual is exact
    _assert_close_to_ref(out, ref)


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 4096])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 24)])
def test_rotary_on_qkv_view(
    dtype: torch.dtype, n: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    width = num_heads + 2 * num_kv_heads
    qkv = _randn(n, width * head_dim, dtype=dtype, seed=n, scale=3.0)
    original = qkv.clone()
    cos_sin = _cos_sin(n, head_dim, dtype)
    qkv_ref = qkv.clone()
    K.rotary_(qkv.view(n, width, head_dim)[:, : num_heads + num_kv_heads], cos_sin)
    K.rotary_ref_(qkv_ref.view(n, width, head_dim)[:, : num_heads + num_kv_heads], cos_sin)
    assert torch.equal(qkv, qkv_ref)
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], original[:, v_start:])  # V untouched
    assert not torch.equal(qkv[:, :v_start], original[:, :v_start])


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 4096])
def test_silu_mul(dtype: torch.dtype, n: int) -> None:
    inter = 1536 if n < 4096 else 256
    gu = _randn(n, 2 * inter, dtype=dtype, seed=n, scale=4.0)
    out = K.silu_mul(gu)
    assert out.shape == (n, inter) and out.is_contiguous()
    _assert_close_to_ref(out, K.silu_mul_ref(gu))


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_special_values(dtype: torch.dtype) -> None:
    special = [math.inf, -math.inf, math.nan, 0.0, -0.0, 100.0, -100.0, 88.9, -88.9, -104.0, -120.0, 1e-3]
    gate = torch.tensor(special)
    gu = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1).to(dtype)
    out, ref = K.silu_mul(gu), K.silu_mul_ref(gu)
    assert torch.equal(out.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert torch.equal(out[keep], ref[keep])


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (9, 3)])
def test_paged_decode_attention(
    dtype: torch.dtype, block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    seq_lens = [1, 5, 16, 17, 100]
    case = _AttentionCase(dtype, num_heads, num_kv_heads, 64, block_size, seq_lens)
    case_ref = case.copy()
    out = K.paged_decode_attention(*case.args())
    ref = K.paged_decode_attention_ref(*case_ref.args())
    assert out.shape == (len(seq_lens), num_heads, 64) and out.dtype == dtype and out.is_contiguous()
    case.check_cache()
    assert torch.equal(case.kv_cache, case_ref.kv_cache)
    _assert_attention(out, ref, dtype)
    _assert_attention(out, case.expected_sdpa(), dtype)


@on_each_variant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [24, 80, 128])
def test_paged_decode_attention_other_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    # 24 and 80 end in a partial 32-element chunk; block size 5 does not divide the 16-position tiles
    case = _AttentionCase(dtype, 6, 2, head_dim, 5, [3, 8, 33, 70])
    out = K.paged_decode_attention(*case.args())
    case.check_cache()
    _assert_attention(out, case.expected_sdpa(), dtype)


@on_each_variant
def test_paged_decode_attention_large_batch() -> None:
    # 64 sequences: the OpenMP path, with every sequence's own block table.
    seq_lens = [(7 * i) % 90 + 1 for i in range(64)]
    case = _AttentionCase(BF16, 9, 3, 64, 16, seq_lens)
    out = K.paged_decode_attention(*case.args())
    case.check_cache()
    _assert_attention(out, case.expected_sdpa(), BF16)


@on_each_variant
def test_paged_decode_attention_skips_negative_slots() -> None:
    case = _AttentionCase(torch.float32, 4, 2, 64, 4, [5, 9])
    case.slot_mapping[1] = -1  # a padding row: writes nowhere
    before = case.kv_cache.clone()
    case_ref = case.copy()
    out = K.paged_decode_attention(*case.args())
    ref = K.paged_decode_attention_ref(*case_ref.args())
    assert torch.equal(case.kv_cache, case_ref.kv_cache)
    num_slots = before.shape[1] * before.shape[2]
    changed = (case.kv_cache != before).reshape(2, num_slots, -1).any(-1).any(0)  # per slot, K or V
    assert changed.nonzero().flatten().tolist() == [int(case.slot_mapping[0])]
    _assert_attention(out, ref, torch.float32)


@on_each_variant
@pytest.mark.parametrize("field", ["block", "seq_len", "slot"])
def test_paged_decode_attention_rejects_bad_indices(field: str) -> None:
    case = _AttentionCase(torch.float32, 4, 2, 64, 4, [5, 9])
    num_blocks = case.kv_cache.shape[1]
    if field == "block":
        case.block_tables[1, 0] = num_blocks
    elif field == "seq_len":
        case.seq_lens[0] = case.block_tables.shape[1] * 4 + 1
    else:
        case.slot_mapping[0] = num_blocks * 4
    before = case.kv_cache.clone()
    with pytest.raises(IndexError):
        K.paged_decode_attention(*case.args())
    assert torch.equal(case.kv_cache, before)  # checked before anything is written


@on_each_variant
def test_paged_decode_attention_rejects_mismatched_shapes() -> None:
    case = _AttentionCase(torch.float32, 4, 2, 64, 4, [5, 9])
    args = list(case.args())
    args[1] = case.query[:, :1]  # one KV head where the cache has two
    with pytest.raises(ValueError, match="shapes do not match"):
        K.paged_decode_attention(*args)


@on_each_variant
def test_one_openmp_runtime() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    x = _randn(4096, 576)
    K.rms_norm(x, _randn(576), EPS)  # a parallel region in the library
    _ = x @ x[:64].T  # and one in torch
    mapped = {
        line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line
    }
    torch_lib = Path(torch.__file__).parent / "lib"
    # Our library runs on torch's runtime; other packages may vendor their own renamed copies
    # (sentencepiece.libs/libgomp-<hash>.so), which never run our kernels. The plain system
    # libgomp.so.1 would mean a second runtime brought in by us.
    assert any(Path(m).parent == torch_lib for m in mapped), mapped
    assert not [m for m in mapped if Path(m).name == "libgomp.so.1" and Path(m).parent != torch_lib], mapped


# --- fallbacks ---------------------------------------------------------------------------------------------


def test_float16_uses_the_references() -> None:
    x, w = _randn(3, 32, dtype=torch.float16), _randn(32, dtype=torch.float16, seed=1)
    assert torch.equal(K.rms_norm(x, w, EPS), K.rms_norm_ref(x, w, EPS))
    gu = _randn(3, 64, dtype=torch.float16)
    assert torch.equal(K.silu_mul(gu), K.silu_mul_ref(gu))


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_the_library_everything_falls_back(dtype: torch.dtype) -> None:
    in_force = K.variant()  # the best here, or IZH_CPU_KERNELS's
    with K.use_variant("off"):
        assert not K.available() and K.variant() is None
        assert not K.qgemm_available() and K.qgemm_max_rows() == 0
        x, w = _randn(3, 64, dtype=dtype), _randn(64, dtype=dtype, seed=1)
        assert torch.equal(K.rms_norm(x, w, EPS), K.rms_norm_ref(x, w, EPS))
        res_a, res_b = _randn(3, 64, dtype=dtype, seed=2), _randn(3, 64, dtype=dtype, seed=2)
        assert torch.equal(K.add_rms_norm_(x, res_a, w, EPS), K.add_rms_norm_ref_(x, res_b, w, EPS))
        assert torch.equal(res_a, res_b)
        qkv_a = _randn(3, 8 * 16, dtype=dtype, seed=3)
        qkv_b = qkv_a.clone()
        cos_sin = _cos_sin(3, 16, dtype)
        K.rotary_(qkv_a.view(3, 8, 16)[:, :6], cos_sin)
        K.rotary_ref_(qkv_b.view(3, 8, 16)[:, :6], cos_sin)
        assert torch.equal(qkv_a, qkv_b)
        gu = _randn(3, 64, dtype=dtype, seed=4)
        assert torch.equal(K.silu_mul(gu), K.silu_mul_ref(gu))
        case = _AttentionCase(dtype, 4, 2, 16, 4, [3, 7])
        case_ref = case.copy()
        out = K.paged_decode_attention(*case.args())
        assert torch.equal(out, K.paged_decode_attention_ref(*case_ref.args()))
        assert torch.equal(case.kv_cache, case_ref.kv_cache)
        logits = _randn(3, 50, seed=5)
        assert torch.equal(K.argmax_rows(logits), K.argmax_rows_ref(logits))
        assert K.top_p_mask_(logits, torch.full((3,), 0.5)) is None
    assert K.variant() == in_force  # back to the one in force


# --- variants: selection, the switch ------------------------------------------------------------------------

ZEN3 = "fpu sse2 ssse3 sse4_1 sse4_2 cx16 popcnt lahf_lm abm movbe xsave avx avx2 bmi1 bmi2 f16c fma"
SKYLAKE_X = ZEN3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni"
SAPPHIRE_RAPIDS = SKYLAKE_X + " avx512_bf16 amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize(
    ("flags", "machine", "best", "runnable"),
    [
        (ZEN3, "x86_64", "avx2", ["avx2", "generic"]),
        (SKYLAKE_X, "x86_64", "avx2", ["avx2", "generic"]),  # AVX-512 without BF16
        (SKYLAKE_X + " avx512_bf16", "x86_64", "avx512", ["avx512", "avx2", "generic"]),
        (SAPPHIRE_RAPIDS, "x86_64", "amx", ["amx", "avx512", "avx2", "generic"]),
        ("fpu sse2 ssse3 avx", "x86_64", "generic", ["generic"]),
        ("fp asimd evtstrm aes pmull asimddp", "aarch64", "neon", ["neon", "generic"]),
        ("fp asimd evtstrm aes pmull", "aarch64", "generic", ["generic"]),  # NEON without dotprod
        ("fp", "aarch64", "generic", ["generic"]),
        ("", "riscv64", "generic", ["generic"]),
    ],
)
def test_variant_selection_from_flags(flags: str, machine: str, best: str, runnable: list[str]) -> None:
    assert K.select_variant("auto", flags.split(), machine).variant == best
    assert K.runnable_variants(flags.split(), machine) == runnable


def test_selection_reasons_name_the_flags() -> None:
    assert K.select_variant("auto", ZEN3.split(), "x86_64").reason.startswith(
        "this CPU has avx2 fma f16c, no avx512f"
    )
    no_bf16 = K.select_variant("auto", SKYLAKE_X.split(), "x86_64")
    assert no_bf16.reason == "this CPU has avx2 fma f16c, no avx512_bf16"
    assert K.select_variant("generic", ZEN3.split(), "x86_64").variant == "generic"


def test_an_unrunnable_variant_is_refused_naming_what_is_missing() -> None:
    lacking = "avx512_bf16 avx512_vnni avx512bw avx512cd avx512dq avx512f avx512vl"
    with pytest.raises(
        ValueError, match=rf"avx512 variant .* lacks {lacking} \(runnable here: avx2, generic\)"
    ):
        K.select_variant("avx512", ZEN3.split(), "x86_64")
    with pytest.raises(ValueError, match="amx_bf16 amx_tile"):
        K.select_variant("amx", (SKYLAKE_X + " avx512_bf16").split(), "x86_64")
    with pytest.raises(ValueError, match="for aarch64 CPUs; this machine is x86_64"):
        K.select_variant("neon", ZEN3.split(), "x86_64")
    with pytest.raises(ValueError, match="unknown CPU kernel variant 'sse9'"):
        K.select_variant("sse9", ZEN3.split(), "x86_64")


def test_variant_flags() -> None:
    def flags(name: str, machine: str = "x86_64") -> list[str]:
        return B.compile_command(name, "o", ["s.c"], machine=machine, torch_gomp=False)

    assert flags("generic")[: len(B.BASE_CFLAGS) + 3] == [
        "gcc",
        *B.BASE_CFLAGS,
        "-march=x86-64",
        "-mtune=generic",
    ]
    assert "-march=x86-64-v3" in flags("avx2") and "-march=native" not in flags("avx2")
    assert {"-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mprefer-vector-width=512"} <= set(
        flags("avx512")
    )
    assert {"-mamx-tile", "-mamx-bf16", "-mavx512bf16"} <= set(flags("amx"))
    assert "-march=armv8.2-a+dotprod" in flags("neon", "aarch64") and "-march=armv8-a" in flags(
        "generic", "aarch64"
    )


def test_forcing_a_variant_this_cpu_cannot_run_is_a_load_error(kernel_state: None) -> None:
    for name in K.VARIANT_NAMES:
        if name in K.runnable_variants():
            continue
        with pytest.raises(ModelLoadError, match=f"engine.cpu_kernels = {name}: "):
            K.configure(name)


def test_off_runs_the_torch_fallbacks(tmp_path: Path, kernel_state: None) -> None:
    K.configure("off", tmp_path)
    assert K.variant() is None and not K.available() and not K.qgemm_available()
    x, w = _randn(3, 64), _randn(64, seed=1)
    assert torch.equal(K.rms_norm(x, w, EPS), K.rms_norm_ref(x, w, EPS))
    assert not (tmp_path / "kernels").exists()  # nothing built


def test_off_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_state: None
) -> None:
    monkeypatch.setenv("IZH_CPU_KERNELS", "0")
    monkeypatch.delenv("IZH_ENGINE__CPU_KERNELS", raising=False)
    K.configure(None, tmp_path)
    assert K.variant() is None
    assert list(tmp_path.iterdir()) == []


@needs_c
def test_the_cache_folder_follows_the_setting(tmp_path: Path, kernel_state: None) -> None:
    # The library cached for the default folder, put where the setting points: found there, not rebuilt.
    built = K.build(L.STATE.kernels_dir, variant="generic")
    assert built.path is not None
    (tmp_path / "kernels").mkdir()
    shutil.copy(built.path, tmp_path / "kernels" / built.path.name)
    K.configure("generic", tmp_path)
    assert L.STATE.kernels_dir == tmp_path / "kernels"
    assert K.variant() == "generic"
    assert L.resolve().path == tmp_path / "kernels" / built.path.name


def test_the_default_cache_folder_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IZH_MODEL__CACHE_DIR", raising=False)
    monkeypatch.setenv("IZH_CACHE_DIR", str(tmp_path))
    assert K.default_cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("IZH_MODEL__CACHE_DIR", str(tmp_path / "m"))
    assert K.default_cache_dir() == tmp_path / "m" / "kernels"


@needs_c
def test_each_variant_is_its_own_library() -> None:
    libs = [K.load_variant(name) for name in VARIANTS_HERE]
    assert len({lib.path for lib in libs}) == len(libs)
    assert [lib.variant for lib in libs] == VARIANTS_HERE
    for lib in libs:
        assert lib.path is not None and lib.path.name.startswith(f"izh_cpu-{lib.variant}-")
        assert bool(lib.qgemm) == (lib.variant in ("avx512", "amx"))
    assert K.load_variant(VARIANTS_HERE[0]) is libs[0]  # loaded once


# --- build and cache ------------------------------------------------------------------------------------


def _tiny_sources(folder: Path) -> Path:
    folder.mkdir()
    (folder / "common.h").write_text("#define IZH_TINY 41\n")
    (folder / "a.c").write_text('#include "common.h"\nint izh_tiny(void) { return IZH_TINY + 1; }\n')
    return folder


@needs_c
def test_build_reuses_the_cached_library(tmp_path: Path) -> None:
    src = _tiny_sources(tmp_path / "src")
    cache = tmp_path / "kernels"
    first = K.build(cache, variant="generic", source_dir=src)
    assert first.path is not None and first.compiled and first.error is None
    assert first.path.parent == cache and first.path.name.startswith("izh_cpu-generic-")
    stamp = first.path.stat().st_mtime_ns
    second = K.build(cache, variant="generic", source_dir=src)
    assert second.path == first.path and not second.compiled
    assert first.path.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache.iterdir()) == [first.path.name]  # no temp files


@needs_c
def test_every_source_file_is_compiled_and_hashed(tmp_path: Path) -> None:
    import ctypes

    src = _tiny_sources(tmp_path / "src")
    cache = tmp_path / "kernels"
    first = K.build(cache, variant="generic", source_dir=src)
    (src / "common.h").write_text("#define IZH_TINY 1\n")  # a header change is a new library
    second = K.build(cache, variant="generic", source_dir=src)
    (src / "b.c").write_text('#include "common.h"\nint izh_tiny_b(void) { return 7; }\n')  # a new file
    third = K.build(cache, variant="generic", source_dir=src)
    assert first.path and second.path and third.path
    assert len({first.path, second.path, third.path}) == 3
    lib = ctypes.CDLL(str(third.path))
    assert lib.izh_tiny() == 2 and lib.izh_tiny_b() == 7


def test_the_shipped_sources() -> None:
    names = {p.name for p in B.source_files()}
    assert {"norm.c", "attention.c", "qgemm_avx512.c", "stack.c", "sampling.c"} <= names
    assert (B.CSRC / "common.h").is_file()


def test_missing_compiler() -> None:
    result = K.build(compiler="izh-no-such-compiler")
    assert result.path is None and result.error is not None and "compiler" in result.error


@needs_c
def test_failed_build_warns_once_and_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kernel_state: None
) -> None:
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "broken.c").write_text("int izh_broken(void) { return syntax error; }\n")
    monkeypatch.setattr(B, "CSRC", broken)
    K.configure("auto", tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger=K.__name__):
        assert not K.available() and K.variant() is None
        assert not K.available()  # resolved once: no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "syntax" in warnings[0].getMessage()
    assert "torch fallbacks" in warnings[0].getMessage()
    assert [p.name for p in (tmp_path / "cache" / "kernels").iterdir()] == []  # the temp file is gone


@needs_c
def test_the_variant_in_force_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kernel_state: None
) -> None:
    K.configure("auto")
    L.STATE.active = None
    with caplog.at_level(logging.INFO, logger=K.__name__):
        K.available()
        K.rms_norm(_randn(2, 8), _randn(8), EPS)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("izh CPU kernels: ")]
    best = K.select_variant("auto")
    assert lines == [f"izh CPU kernels: {best.variant} ({best.reason})"]


# --- aarch64: the sources cross-compile ----------------------------------------------------------------

CROSS_CC = "aarch64-linux-gnu-gcc"


@pytest.mark.skipif(
    shutil.which(CROSS_CC) is None, reason=f"{CROSS_CC} not installed (gcc-aarch64-linux-gnu)"
)
def test_the_sources_compile_for_aarch64(tmp_path: Path) -> None:
    """The neon and generic variants' flags, with Debian's cross compiler: a shared object when the cross
    libgomp is there, else objects; either way AArch64 code (no x86 intrinsic outside its guards)."""
    sources = [str(p) for p in B.source_files()]
    probe = subprocess.run([CROSS_CC, "-print-file-name=libgomp.so"], capture_output=True, text=True)
    shared = probe.returncode == 0 and Path(probe.stdout.strip()).is_absolute()
    runs = {}
    for name in ("neon", "generic"):
        out = tmp_path / name
        out.mkdir()
        cmd = B.compile_command(
            name, str(out / "izh_cpu.so"), sources, compiler=CROSS_CC, machine="aarch64", torch_gomp=False
        )
        if not shared:
            cmd = [arg for arg in cmd if arg not in ("-shared", "-lm")]
            cmd = [*cmd[: cmd.index("-o")], "-c", *sources]
        runs[name] = subprocess.Popen(
            cmd, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for name, proc in runs.items():
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {output[-3000:]}"
        built = sorted((tmp_path / name).glob("*.so" if shared else "*.o"))
        assert built, name
        for path in built:
            header = subprocess.run(["readelf", "-h", str(path)], capture_output=True, text=True, check=True)
            assert "AArch64" in header.stdout, (name, path.name, header.stdout)


# --- helpers ----------------------------------------------------------------------------------------------


def _cos_sin(n: int, head_dim: int, dtype: torch.dtype) -> Tensor:
    half = head_dim // 2
    positions = torch.arange(n, dtype=torch.float32)[:, None] + 3
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions * freqs
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def _assert_attention(out: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=atol)


class _AttentionCase:
    """A decode batch over a paged cache: each sequence's context is known in full (`contexts`), its
    first seq_len - 1 positions are already in the cache at shuffled blocks, the last one comes in
    through key/value, which with query are strided views of one qkv buffer."""

    def __init__(
        self,
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        seq_lens: list[int],
        seed: int = 0,
    ) -> None:
        gen = _gen(seed)
        n = len(seq_lens)
        self.dtype, self.num_heads, self.num_kv_heads, self.head_dim = (
            dtype,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.scale = head_dim**-0.5
        blocks_per_seq = [math.ceil(length / block_size) for length in seq_lens]
        max_blocks = max(blocks_per_seq) + 1
        num_blocks = sum(blocks_per_seq) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        # unused table entries hold garbage: they must never be read
        self.block_tables = torch.full((n, max_blocks), 10**6, dtype=torch.int32)
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(
            dtype
        )
        width = num_heads + 2 * num_kv_heads
        self.qkv = torch.randn(n, width * head_dim, generator=gen).to(dtype)
        view = self.qkv.view(n, width, head_dim)
        self.query = view[:, :num_heads]
        self.key = view[:, num_heads : num_heads + num_kv_heads]
        self.value = view[:, num_heads + num_kv_heads :]
        self.contexts: list[tuple[Tensor, Tensor]] = []
        slots = []
        for i, length in enumerate(seq_lens):
            own = [order.pop() for _ in range(blocks_per_seq[i])]
            self.block_tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
            k_ctx = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_ctx = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
            k_ctx[-1], v_ctx[-1] = self.key[i], self.value[i]
            for p in range(length - 1):
                self.kv_cache[0, own[p // block_size], p % block_size] = k_ctx[p]
                self.kv_cache[1, own[p // block_size], p % block_size] = v_ctx[p]
            self.contexts.append((k_ctx, v_ctx))
            last = length - 1
            slots.append(own[last // block_size] * block_size + last % block_size)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)

    def copy(self) -> _AttentionCase:
        other = object.__new__(_AttentionCase)
        other.__dict__.update(self.__dict__)
        other.kv_cache = self.kv_cache.clone()
        other.slot_mapping = self.slot_mapping.clone()
        return other

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float]:
        return (
            self.query,
            self.key,
            self.value,
            self.kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.scale,
        )

    def check_cache(self) -> None:
        slots_k = self.kv_cache[0].reshape(-1, self.num_kv_heads, self.head_dim)
        slots_v = self.kv_cache[1].reshape(-1, self.num_kv_heads, self.head_dim)
        for i, slot in enumerate(self.slot_mapping.tolist()):
            assert torch.equal(slots_k[slot], self.key[i])
            assert torch.equal(slots_v[slot], self.value[i])

    def expected_sdpa(self) -> Tensor:
        group = self.num_heads // self.num_kv_heads
        outs = []
        for i, (k_ctx, v_ctx) in enumerate(self.contexts):
            q = self.query[i].float()[:, None, :]  # [H, 1, d]
            k = k_ctx.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
            v = v_ctx.float().repeat_interleave(group, dim=1).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(q, k, v, scale=self.scale)[:, 0])
        return torch.stack(outs)


# --- quantized record matmuls ----------------------------------------------------------------------------

QGEMM_VARIANTS_HERE = [name for name in VARIANTS_HERE if name in ("avx512", "amx")]
_NO_QGEMM = pytest.param(
    None,
    marks=pytest.mark.skip(reason="record kernels need the avx512 or amx variant (AVX512-BW + AVX512-BF16)"),
)


@pytest.fixture(params=QGEMM_VARIANTS_HERE or [_NO_QGEMM])
def each_qgemm_variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every variant with the record matmuls that this CPU runs, through the module-level wrappers."""
    with K.use_variant(request.param):
        assert K.qgemm_available()
        yield request.param


needs_qgemm = pytest.mark.usefixtures("each_qgemm_variant")


def _q4_parts(n: int, k: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = _gen(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4
    mins = -torch.rand(n, k // 32, generator=g) * 0.08
    return codes, scales, mins


def _assert_matmul_close(out: Tensor, ref: Tensor) -> None:
    """bf16 matmul outputs: the reference's value or one ulp off (fp32 sums in another order, one rounding),
    plus an absolute slack of 1e-5 of the largest output for results near zero, where the fp32 rounding
    of the sum exceeds a bf16 ulp of the tiny result; at least 99% identical."""
    assert out.dtype == ref.dtype == BF16 and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    ulp = _bf16_ulp(torch.maximum(out.float().abs(), ref.float().abs()))
    assert bool((diff <= ulp + 1e-5 * ref.float().abs().max()).all()), f"max diff {diff.max().item()}"
    assert (out == ref).float().mean().item() >= 0.99


def _per_input(v: Tensor) -> Tensor:
    return v.to(BF16).float().repeat_interleave(32, dim=1)


def test_q4_records_unpack_to_code_times_scale_plus_min() -> None:
    codes, scales, mins = _q4_parts(48, 96, seed=1)
    records = K.pack_q4(codes, scales, mins)
    assert records.shape == (3, 3, K.Q4_RECORD_BYTES) and records.dtype == torch.uint8
    expected = codes.float() * _per_input(scales) + _per_input(mins)
    assert torch.equal(K.unpack_q4(records, 48, 96), expected)
    # The layout the kernel reads: row 5's codes for inputs 0..3 of tile 0, group 0 sit in block 0,
    # bytes 10 and 11, as (input 0 | input 2 << 4) and (input 1 | input 3 << 4).
    assert records[0, 0, 10].item() == codes[5, 0].item() | codes[5, 2].item() << 4
    assert records[0, 0, 11].item() == codes[5, 1].item() | codes[5, 3].item() << 4


def test_q8_records_unpack_to_code_times_scale() -> None:
    g = _gen(2)
    codes = torch.randint(-128, 128, (32, 64), generator=g)
    scales = torch.rand(32, 2, generator=g) * 0.01
    records = K.pack_q8(codes, scales)
    assert records.shape == (2, 2, K.Q8_RECORD_BYTES)
    assert torch.equal(K.unpack_q8(records, 32, 64), codes.float() * _per_input(scales))


def test_record_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="out % 16"):
        K.pack_q4(torch.zeros(24, 64, dtype=torch.long), torch.ones(24, 2), torch.zeros(24, 2))
    with pytest.raises(ValueError, match="in % 32"):
        K.pack_q8(torch.zeros(16, 40, dtype=torch.long), torch.ones(16, 1))


# Row counts across both kernels: AVX-512 for few rows, AMX (weights rounded to bf16) for more.
ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64]


def _rows_here() -> list[int]:
    return [m for m in ROWS if m <= K.qgemm_max_rows()]


@needs_qgemm
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("n", "k"), [(16, 32), (960, 576), (64, 1536)])
def test_q4_matmul(m: int, n: int, k: int) -> None:
    if m > K.qgemm_max_rows():
        pytest.skip(f"{m} rows need AMX here")
    records = K.pack_q4(*_q4_parts(n, k, seed=m))
    x = _randn(m, k, dtype=BF16, seed=10 + m)
    amx = K.qgemm_uses_amx(4, m)
    # fp32 accumulation in another order, one rounding to bf16: the reference's bf16 or one ulp off.
    ref = K.q4_matmul_ref(x, records, n, k, bf16_weights=amx)
    _assert_matmul_close(K.q4_matmul(x, records, n, k), ref)
    logits = torch.empty(m + 3, n)
    K.q4_matmul(x, records, n, k, out=logits)
    ref = K.q4_matmul_ref(x, records, n, k, torch.float32, bf16_weights=amx)
    assert torch.allclose(logits[:m], ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@needs_qgemm
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 24, 64])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (512, 576)])
def test_q8_matmul(m: int, n: int, k: int) -> None:
    if m > K.qgemm_max_rows():
        pytest.skip(f"{m} rows need AMX here")
    g = _gen(m)
    records = K.pack_q8(
        torch.randint(-127, 128, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.01
    )
    x = _randn(m, k, dtype=BF16, seed=20 + m)
    amx = K.qgemm_uses_amx(8, m)
    _assert_matmul_close(K.q8_matmul(x, records, n, k), K.q8_matmul_ref(x, records, n, k, bf16_weights=amx))
    logits = torch.empty(m, n)
    K.q8_matmul(x, records, n, k, out=logits)
    ref = K.q8_matmul_ref(x, records, n, k, torch.float32, bf16_weights=amx)
    assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@needs_qgemm
def test_amx_serves_the_larger_row_counts_where_it_runs() -> None:
    if K.qgemm_max_rows() == 8:
        assert not K.qgemm_uses_amx(4, 8)
        pytest.skip("no AMX here: 8 rows through AVX-512")
    assert K.qgemm_max_rows() == 64
    assert not K.qgemm_uses_amx(4, 4) and K.qgemm_uses_amx(4, 5) and K.qgemm_uses_amx(4, 64)
    assert not K.qgemm_uses_amx(8, 8) and K.qgemm_uses_amx(8, 9) and not K.qgemm_uses_amx(8, 65)


@needs_qgemm
def test_q4_matmul_reads_strided_rows() -> None:
    records = K.pack_q4(*_q4_parts(32, 64, seed=3))
    wide = _randn(3, 100, dtype=BF16, seed=4)
    x = wide[:, 10:74]  # row stride 100
    assert torch.equal(K.q4_matmul(x, records, 32, 64), K.q4_matmul(x.contiguous(), records, 32, 64))


def test_record_matmuls_fall_back_to_the_reference() -> None:
    """bfloat16 input with more rows than the bfloat16 kernels take: the bfloat16 reference answers;
    float32 input without the library: the float32 (int8-activation) reference does."""
    records = K.pack_q4(*_q4_parts(16, 32, seed=5))
    x = _randn(K.qgemm_max_rows() + 1, 32, dtype=BF16, seed=7)
    assert torch.equal(K.q4_matmul(x, records, 16, 32), K.q4_matmul_ref(x, records, 16, 32))
    x32 = _randn(2, 32, seed=6)
    with K.use_variant("off"):
        assert torch.equal(K.q4_matmul(x32, records, 16, 32), K.q4_matmul_x8_ref(x32, records, 16, 32))


# --- greedy argmax ----------------------------------------------------------------------------------------


@on_each_variant
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (1, 15), (3, 16), (5, 49152), (64, 1000), (2, 33)])
def test_argmax_rows_matches_torch_max(rows: int, n: int) -> None:
    x = _randn(rows, n, seed=rows * n)
    assert torch.equal(K.argmax_rows(x), K.argmax_rows_ref(x))


@on_each_variant
def test_argmax_rows_first_maximum_infinities_and_nan() -> None:
    x = torch.zeros(6, 40)
    x[0, [7, 3, 30]] = 2.0  # ties: the first index
    x[1] = -torch.inf  # all -inf: index 0
    x[2, 35] = torch.inf
    x[2, 36] = torch.inf
    x[3, [5, 20]] = torch.nan  # the first NaN wins, as in torch.max
    x[4, 39] = 1.0  # the tail past the last 16-wide chunk
    x[5, ::3] = -1.0
    assert K.argmax_rows(x).tolist() == [3, 0, 35, 5, 39, 1]
    assert torch.equal(K.argmax_rows(x), K.argmax_rows_ref(x))
    strided = torch.zeros(3, 64)[:, :40]  # a row stride: still one pass per row
    strided[1, 17] = 1.0
    assert K.argmax_rows(strided).tolist() == [0, 17, 0]


@on_each_variant
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (3, 7), (4, 300), (33, 49152)])
def test_sample_rows_draws_where_the_reference_does(rows: int, n: int) -> None:
    """Same rule as softmax + float64 inverse CDF; a draw may differ only within rounding of a token
    boundary of the reference's CDF."""
    logits = _randn(rows, n, seed=rows + n, scale=3.0)
    uniform = torch.rand(rows, dtype=torch.float64, generator=_gen(n))
    got = K.sample_rows(logits, uniform)
    ref = K.sample_rows_ref(logits, uniform)
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)
    targets = uniform * cdf[:, -1]
    for r in torch.nonzero(got != ref).flatten().tolist():
        boundary = cdf[r, min(int(got[r]), int(ref[r]))]
        assert abs(float(boundary - targets[r])) < 1e-6, (r, int(got[r]), int(ref[r]))
    assert (got == ref).float().mean().item() >= 0.9


@on_each_variant
def test_sample_rows_edges() -> None:
    logits = torch.full((5, 40), -torch.inf)
    logits[0, 17] = 0.0  # one allowed token: always it
    logits[1, [3, 30]] = 0.0  # two equal ones: u < 0.5 -> the first, else the second
    logits[2, [3, 30]] = 0.0
    logits[3, 39] = 5.0  # the last token
    uniform = torch.tensor([0.99, 0.49, 0.51, 0.7, 0.3], dtype=torch.float64)
    # row 4: all -inf -> token 0
    assert K.sample_rows(logits, uniform).tolist() == [17, 3, 30, 39, 0]
    # u just below 1 with one token of tiny weight at the end: still never a zero-probability token
    tail = torch.full((1, 64), -torch.inf)
    tail[0, 10] = 0.0
    tail[0, 50] = -30.0
    one = torch.tensor([1 - 2**-52], dtype=torch.float64)
    assert K.sample_rows(tail, one).item() in (10, 50)
