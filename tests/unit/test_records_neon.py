"""The NEON path of the float32 record matmuls (csrc/records_neon.h), run for real under qemu-aarch64.

tests/unit/records_harness.c computes izh_q4_gemm_f32 / izh_q8_gemm_f32 on deterministic records and
activations (its own RNG) for M = 1, 2, 3, 5, 9, 17, N = 16, 48, 96, K = 32, 64, 288 and OpenMP teams of 1
and 2, and prints a hash of every output row. It is built with the kernel variants' own flags for aarch64
(NEON, run under qemu), x86-64 (the portable C path) and, where this CPU has it, x86-64-v3 (AVX2): the
integer sums are exact and the float epilogue is one fixed sequence of operations, so all of them must
print the same bytes.

The harness links records_f32.c alone (-ffunction-sections -Wl,--gc-sections drops the float32 decode
stack, the only user of the other files' functions), falling back to every csrc/*.c when that does not
link. Skips without the cross compiler (gcc-aarch64-linux-gnu), qemu-aarch64 (qemu-user), a host gcc, or
an x86-64 host."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from izh.kernels.cpu import compiler as B
from izh.kernels.cpu import variants as V
from tests.cross_aarch64 import CROSS_CC, QEMU, SKIPS, build_harness, cross_static, harness_env, sysroot

HARNESS = Path(__file__).with_name("records_harness.c")

pytestmark = SKIPS

ROWS = sum((1, 2, 3, 5, 9, 17)) * 3 * 3 * 2 * 2  # row hashes: sum(M) x 3 N x 3 K x 2 kinds x 2 teams
LINE = re.compile(r"^(q[48]) K=(\d+) N=(\d+) M=(\d+) nt=(\d) row=(\d+) ([0-9a-f]{16})$")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The harness's output per build: neon (under qemu), generic, and avx2 where this CPU runs it."""
    tmp = tmp_path_factory.mktemp("records_neon")
    neon_flags = list(V.get_variant("neon", "aarch64").cflags) + (["-static"] if cross_static() else [])
    builds = {"neon": (CROSS_CC, neon_flags)}
    builds["generic"] = (B.CC, list(V.get_variant("generic", "x86_64").cflags))
    if not V.missing_flags("avx2"):
        builds["avx2"] = (B.CC, list(V.get_variant("avx2", "x86_64").cflags))
    procs = {
        name: build_harness(cc, flags, HARNESS, ["records_f32.c"], tmp / f"harness-{name}")
        for name, (cc, flags) in builds.items()
    }
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} build failed:\n{log[-3000:]}"
    # The aarch64 build really has the NEON tiles (records_f32.c includes records_neon.h under __ARM_NEON).
    nm = shutil.which("aarch64-linux-gnu-nm") or shutil.which("nm")
    if nm:
        symbols = subprocess.run([nm, str(tmp / "harness-neon")], capture_output=True, text=True).stdout
        assert "x8_tile_neon_" in symbols, "the aarch64 harness has no NEON tile: records_neon.h not used?"
    env = harness_env()
    runs = {}
    for name in builds:
        exe = str(tmp / f"harness-{name}")
        cmd = [QEMU, "-L", sysroot(), exe] if name == "neon" else [exe]
        runs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    result = {}
    for name, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (
            f"{name} harness exited {proc.returncode}:\n{stdout[-2000:]}\n{stderr[-2000:]}"
        )
        result[name] = stdout
    return result


def test_the_harness_covers_every_shape_on_two_threads(outputs: dict[str, str]) -> None:
    """Every (kind, K, N, M, nt) case ran (rc 0, out's padding untouched), on a real team of two for nt = 2;
    and within one build a row's result depends neither on the other rows of the batch nor on the team."""
    for name, text in outputs.items():
        lines = text.splitlines()
        assert lines[0] == "team 2", (name, lines[0])
        assert lines[-1] == "done", (name, lines[-1])
        rows = [LINE.match(line) for line in lines[1:-1]]
        assert all(rows), (name, [line for line, r in zip(lines[1:-1], rows, strict=True) if not r][:5])
        assert len(rows) == ROWS, (name, len(rows))
        seen: dict[tuple[str, ...], set[str]] = defaultdict(set)
        for r in rows:
            kind, k, n, _m, _nt, row, digest = r.groups()
            seen[(kind, k, n, row)].add(digest)
        assert all(len(d) == 1 for d in seen.values()), (name, {k: d for k, d in seen.items() if len(d) > 1})


def test_neon_is_bit_identical_to_the_portable_and_avx2_paths(outputs: dict[str, str]) -> None:
    reference = outputs["generic"]
    for name, text in outputs.items():
        if text != reference:
            diff = [
                f"generic: {a}  |  {name}: {b}"
                for a, b in zip(reference.splitlines(), text.splitlines(), strict=False)
                if a != b
            ]
            counts = f"{len(reference.splitlines())} vs {len(text.splitlines())} lines"
            pytest.fail(
                f"{name} differs from generic ({counts}; {len(diff)} differ), e.g.\n" + "\n".join(diff[:10])
            )
