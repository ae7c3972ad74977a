"""The GGUF block matmuls (csrc/gguf_blocks.c) built for aarch64 and run for real under qemu-aarch64, against
`gguf_matmul_ref` bit for bit.

tests/unit/gguf_blocks_harness.c runs izh_gguf_matmul_f32 on cases this test writes (random blocks of every
served type, odd weight-row counts, 1-70 activation rows, OpenMP teams of 1 and 2) and writes the outputs
back. Two builds: the neon variant's flags (armv8.2-a + dotprod: the NEON decoders and SDOT), run on
qemu's default CPU, and aarch64's generic variant (armv8-a: SMULL + SADALP, no SDOT in the binary), run
as a Cortex-A53, which has no dotprod. Skips without the cross compiler (gcc-aarch64-linux-gnu),
qemu-aarch64 (qemu-user), a host gcc, or an x86-64 host."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from izh.kernels.cpu import compiler as B
from izh.kernels.cpu import gguf_blocks as G
from izh.kernels.cpu import variants as V
from tests.cross_aarch64 import CFLAGS, CROSS_CC, QEMU, SKIPS, cross_static, harness_env, sysroot
from tests.gguf_blocks_helpers import random_blocks

pytestmark = SKIPS

HARNESS = Path(__file__).with_name("gguf_blocks_harness.c")
ROWS = (1, 2, 3, 5, 8, 13, 31, 64, 65, 70)
BUILDS = {  # build: (variant, qemu's CPU model)
    "neon": ("neon", "max"),
    "generic": ("generic", "cortex-a53"),
}


def _shapes(bs: int) -> list[tuple[int, int]]:
    """(N, K): weight rows not a multiple of 4 (the NEON kernel's group), several blocks per row."""
    return [(37, 2 * bs), (6, 5 * bs if bs == 32 else bs)]


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 3
    x[0, :32] = 0  # an all-zero group of the 32-input blocks: dx = 0
    return x


def _cases() -> list[tuple[str, int, int, int, int, torch.Tensor, np.ndarray]]:
    """(format, N, K, M, nt, x [M, K], raw) per case; x's rows are the first M of one 70-row x per shape."""
    cases = []
    for name in sorted(G.GGUF_BLOCK_TYPES):
        for n, k in _shapes(G.block_size(name)):
            raw = random_blocks(name, n, k, np.random.default_rng(n + k))
            x = _x(max(ROWS), k, k + n)
            cases += [(name, n, k, m, nt, x[:m], raw) for m in ROWS for nt in (1, 2)]
    return cases


def _write(cases: list[tuple[str, int, int, int, int, torch.Tensor, np.ndarray]], path: Path) -> None:
    with path.open("wb") as f:
        for name, n, k, m, nt, x, raw in cases:
            head = [G.GGUF_BLOCK_TYPES[name][0], m, n, k, raw.shape[1], nt]
            f.write(np.array(head, dtype="<i8").tobytes())
            f.write(x.contiguous().numpy().astype("<f4").tobytes())
            f.write(np.ascontiguousarray(raw).tobytes())


def _read(
    path: Path, cases: list[tuple[str, int, int, int, int, torch.Tensor, np.ndarray]]
) -> list[torch.Tensor]:
    data, offset, outs = path.read_bytes(), 0, []
    for name, n, k, m, nt, _, _ in cases:
        rc = int(np.frombuffer(data, dtype="<i8", count=1, offset=offset)[0])
        assert rc == 0, (name, n, k, m, nt, rc)
        offset += 8
        out = np.frombuffer(data, dtype="<f4", count=m * n, offset=offset).reshape(m, n)
        outs.append(torch.from_numpy(out.copy()))
        offset += 4 * m * n
    assert offset == len(data)
    return outs


def _disassembly(exe: Path) -> str:
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump not installed (binutils-aarch64-linux-gnu)")
    return subprocess.run([objdump, "-d", str(exe)], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[torch.Tensor], str]]:
    """Per build: (the harness's stdout, the outputs of every case, the disassembly)."""
    tmp = tmp_path_factory.mktemp("gguf_neon")
    cases = _cases()
    _write(cases, tmp / "cases.bin")
    static = ["-static"] if cross_static() else []
    procs = {}
    for build, (variant, _) in BUILDS.items():
        flags = [*CFLAGS, *V.get_variant(variant, "aarch64").cflags, *static, f"-I{B.CSRC}"]
        cmd = [CROSS_CC, *flags, "-o", str(tmp / build), str(HARNESS), str(B.CSRC / "gguf_blocks.c"), "-lm"]
        procs[build] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for build, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{build} build failed:\n{log[-3000:]}"
    result = {}
    for build, (_, cpu) in BUILDS.items():
        out = tmp / f"{build}.out"
        cmd = [QEMU, "-cpu", cpu, "-L", sysroot(), str(tmp / build), str(tmp / "cases.bin"), str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True, env=harness_env(), timeout=600)
        assert run.returncode == 0, f"{build} harness exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
        result[build] = (run.stdout, _read(out, cases), _disassembly(tmp / build))
    return result


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_format_is_the_reference_bit_for_bit_under_qemu(
    build: str, runs: dict[str, tuple[str, list[torch.Tensor], str]]
) -> None:
    stdout, outs, _ = runs[build]
    assert stdout.splitlines()[0] == "team 2", stdout  # the nt = 2 cases ran on a team of two
    cases = _cases()
    assert stdout.splitlines()[-1] == f"cases {len(cases)}"
    wants: dict[tuple[str, int, int], torch.Tensor] = {}
    for (name, n, k, m, nt, _, raw), got in zip(cases, outs, strict=True):
        if (name, n, k) not in wants:
            x = _x(max(ROWS), k, k + n)
            wants[(name, n, k)] = G.gguf_matmul_ref(x, name, raw, n, k)
        # the reference of all 70 rows: each row's result is the same in any batch
        assert torch.equal(got, wants[(name, n, k)][:m]), (build, name, n, k, m, nt)


def test_the_neon_build_uses_sdot_and_the_generic_one_does_not(
    runs: dict[str, tuple[str, list[torch.Tensor], str]],
) -> None:
    """The neon build's dot products are SDOT (dotprod), the generic build's SMULL + SADALP: qemu ran the
    generic one as a Cortex-A53, which would have trapped on an SDOT."""
    neon, generic = runs["neon"][2], runs["generic"][2]
    assert "\tsdot\t" in neon
    assert "\tsdot\t" not in generic and "\tsadalp\t" in generic
