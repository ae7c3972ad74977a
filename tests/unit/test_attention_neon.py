"""The paged attention kernel (csrc/attention.c) built for aarch64 (NEON) and run for real under qemu-aarch64,
against the x86-64 builds bit for bit.

tests/unit/attention_harness.c drives izh_paged_attention_f32 / _bf16 (and the decode entry points) through
one deterministic cache history per activation dtype (float32, bf16), kv type (float32, bf16, float16,
float8 e4m3 / e5m2, q8_0), head size (64, 128) and OpenMP team (1, 2): 4 query heads over 2 KV heads,
shuffled blocks of 16, a mixed prefill chunk with a padding row, a chunked prefill onto 48 cached tokens,
a decode of three sequences of lengths 1, 17 and 100, a sliding window of 32 (with a freed block before it)
and a soft-capped step. It prints, per call, a hash of the output and one of the whole KV cache. It is built
with the kernel variants' own flags for aarch64 (neon, run under qemu), x86-64 (generic: the portable C
path), x86-64 with -mfma (fma: the same portable path where fused multiply-adds exist; not a shipped
variant) and, where this CPU runs them, avx2 and avx512.

What is bit-identical, and what is not:
  - The KV cache, in every build: the kv types' conversions (kv_write_row) are exact roundings.
  - The outputs of neon, fma and avx512: the attention item functions and izh_paged_attention_* are FAST_FP
    (common.h: optimize("fp-contract=fast")), so gcc fuses their multiply-adds into FMAs wherever the
    target has them: always on aarch64 (FMLA), with x86-64-v3 / v4 or -mfma on x86-64. These builds run the
    same GCC-vector code (attn_item_vec) and fuse the same products, so they agree to the bit. avx512's bf16 x
    bf16 scores go through vdpbf16ps instead (another summation order, but of exact bf16 products: equal on
    these inputs).
  - Not avx512's float32 activations over a bf16 cache: that build runs them on vdpbf16ps (attn_items_dp,
    attn_bf16_path 1), which rounds q and the softmax weights to bf16 as the AMX tiles do, another recipe
    than the float32 items' over rows converted to float32. tests/unit/test_kv_cache_dtype.py checks it
    against a float64 reference, whole == chunked == decoded, on the CPUs that run it.
  - Not generic's outputs: plain x86-64 has no FMA instruction, so there each product is rounded before it
    is added. With FAST_FP defined empty, neon, avx512 and generic agree to the bit (checked by hand); as it
    is, float32 activations differ in most outputs (about 30 float32 ulps of the head's largest output at
    most), bf16 ones in a few (1 bf16 ulp, the float32 difference mostly rounded away). Batch invariance is
    a promise within one build, which this does not touch; the x86 builds are checked against a float64
    reference in tests/unit/test_kv_cache_dtype.py, and neon equals fma to the bit.
  - avx2's float32 activations: they take attn_item_f32_avx2 / attn_item_conv_avx2 (the
    `#if defined(__AVX2__) && !defined(__AVX512F__)` section: 8-lane scores and another summation order);
    its bf16 activations take attn_item_vec as neon does, and equal neon's.
Within every build, a team of two gives the same bits as one thread.

The harness links attention.c alone (-ffunction-sections -Wl,--gc-sections), falling back to every
csrc/*.c when that does not link. Skips without the cross compiler (gcc-aarch64-linux-gnu), qemu-aarch64
(qemu-user), a host gcc, or an x86-64 host."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from izh.kernels.cpu import compiler as B
from izh.kernels.cpu import variants as V
from tests.cross_aarch64 import CROSS_CC, QEMU, SKIPS, build_harness, cross_static, harness_env, sysroot

HARNESS = Path(__file__).with_name("attention_harness.c")

pytestmark = SKIPS

ACTS = ("f32", "bf16")
KV_TYPES = ("f32", "bf16", "f16", "e4m3", "e5m2", "q8_0")  # csrc/common.h's KV_* order
DIMS = ("64", "128")
TEAMS = ("1", "2")
STEPS = ("prefill1", "prefill2", "decode", "window", "softcap")
Key = tuple[str, ...]  # (act, kv, d, nt, step)
CASES: list[Key] = list(itertools.product(ACTS, KV_TYPES, DIMS, TEAMS, STEPS))
LINE = re.compile(
    r"^act=(f32|bf16) kv=(\w+) d=(\d+) nt=(\d) step=(\w+) out=([0-9a-f]{16}) cache=([0-9a-f]{16})$"
)
# The harness's item functions: NEON's fused multiply-add (FMLA on vectors) must be in them.
ITEMS = ("attn_item_f32", "attn_item_bf16", "attn_item_conv_f32", "attn_item_conv_bf16")

Hashes = dict[Key, tuple[str, str]]  # key: (output hash, cache hash)


def _finish(proc: subprocess.Popen[str], what: str, timeout: float) -> tuple[str, str]:
    """proc's stdout and stderr ("" when not piped); kills it and fails when it runs past timeout."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{what} ran past {timeout} s")
    return stdout, stderr or ""


def _hashes(text: str) -> Hashes:
    result: Hashes = {}
    for line in text.splitlines()[1:-1]:
        m = LINE.match(line)
        if m:
            act, kv, d, nt, step, out, cache = m.groups()
            result[(act, kv, d, nt, step)] = (out, cache)
    return result


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The harness's output per build: neon (under qemu), generic, and fma, avx2, avx512 where this CPU
    runs them."""
    tmp = tmp_path_factory.mktemp("attention_neon")
    neon_flags = list(V.get_variant("neon", "aarch64").cflags) + (["-static"] if cross_static() else [])
    generic = list(V.get_variant("generic", "x86_64").cflags)
    builds = {"neon": (CROSS_CC, neon_flags), "generic": (B.CC, generic)}
    if {"avx", "fma"} <= V.cpu_flags():
        builds["fma"] = (B.CC, [*generic, "-mfma"])
    for name in ("avx2", "avx512"):
        if not V.missing_flags(name):
            builds[name] = (B.CC, list(V.get_variant(name, "x86_64").cflags))
    procs = {
        name: build_harness(cc, flags, HARNESS, ["attention.c"], tmp / f"harness-{name}")
        for name, (cc, flags) in builds.items()
    }
    for name, proc in procs.items():
        log, _ = _finish(proc, f"the {name} build", 600)
        assert proc.returncode == 0, f"{name} build failed:\n{log[-3000:]}"
    # The aarch64 build's item functions really are NEON code: vector FMLAs (fp-contract=fast, FAST_FP).
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        for item in ITEMS:
            cmd = [objdump, "-d", f"--disassemble={item}", str(tmp / "harness-neon")]
            asm = subprocess.run(cmd, capture_output=True, text=True).stdout
            assert re.search(r"\tfmla\tv\d+\.4s", asm), f"no NEON FMLA in the aarch64 harness's {item}"
    env = harness_env()
    runs = {}
    for name in builds:
        exe = str(tmp / f"harness-{name}")
        cmd = [QEMU, "-L", sysroot(), exe] if name == "neon" else [exe]
        runs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    result = {}
    for name, proc in runs.items():
        stdout, stderr = _finish(proc, f"the {name} harness", 300)
        assert proc.returncode == 0, (
            f"{name} harness exited {proc.returncode}:\n{stdout[-2000:]}\n{stderr[-2000:]}"
        )
        result[name] = stdout
    return result


def _mismatches(ref: str, ref_name: str, other: str, other_name: str, keys: list[Key], field: int) -> str:
    """A failure message for the keys where `field` (0: output, 1: cache) differs; empty when none does."""
    a, b = _hashes(ref), _hashes(other)
    bad = [k for k in keys if a[k][field] != b[k][field]]
    if not bad:
        return ""
    what = ("outputs", "caches")[field]
    rows = [f"{' '.join(k)}: {ref_name} {a[k][field]}  |  {other_name} {b[k][field]}" for k in bad[:10]]
    return (
        f"{other_name} {what} differ from {ref_name}'s in {len(bad)} of {len(keys)} calls, e.g.\n"
        + "\n".join(rows)
    )


def test_the_harness_covers_every_case_on_two_threads(outputs: dict[str, str]) -> None:
    """Every (act, kv, d, nt, step) call ran (rc 0, out's tail untouched, the padding row zero), on a real
    team of two for nt = 2; and within one build the team changes nothing."""
    for name, text in outputs.items():
        lines = text.splitlines()
        assert lines[0] == "team 2", (name, lines[0])
        assert lines[-1] == "done", (name, lines[-1])
        bad = [line for line in lines[1:-1] if not LINE.match(line)]
        assert not bad, (name, bad[:5])
        assert len(lines) - 2 == len(CASES), (name, len(lines))
        hashes = _hashes(text)
        assert sorted(hashes) == sorted(CASES), name
        split = [k for k in CASES if k[3] == "2" and hashes[k] != hashes[(*k[:3], "1", k[4])]]
        assert not split, (name, split[:5])


def test_every_build_writes_the_same_cache(outputs: dict[str, str]) -> None:
    """The kv types' conversions are exact roundings: every build writes the same cache bytes."""
    for name, text in outputs.items():
        message = _mismatches(outputs["generic"], "generic", text, name, CASES, 1)
        assert not message, message


def test_neon_is_bit_identical_to_the_other_fused_builds(outputs: dict[str, str]) -> None:
    """neon's outputs are fma's and avx512's (the same vector code, the same fused multiply-adds; but
    avx512's float32 activations over a bf16 cache, which run on vdpbf16ps) and, for bf16 activations,
    avx2's (float32 ones take avx2's own item functions)."""
    others = {
        "fma": CASES,
        "avx512": [k for k in CASES if k[:2] != ("f32", "bf16")],
        "avx2": [k for k in CASES if k[0] == "bf16"],
    }
    present = [name for name in others if name in outputs]
    if not present:
        pytest.skip("this CPU has no FMA: no x86-64 build fuses multiply-adds as aarch64 does")
    for name in present:
        message = _mismatches(outputs["neon"], "neon", outputs[name], name, others[name], 0)
        assert not message, message
