"""Building and running C test harnesses for aarch64 on an x86-64 host: Debian's cross compiler
(gcc-aarch64-linux-gnu) and qemu-user's qemu-aarch64 (the tests skip without them)."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from izh.kernels.cpu import compiler as B
from izh.kernels.cpu import variants as V

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
CFLAGS = [f for f in B.BASE_CFLAGS if f not in ("-fPIC", "-shared")]
"""The library's flags without the shared-object ones: a harness is a program."""

SKIPS = [
    pytest.mark.skipif(
        shutil.which(CROSS_CC) is None, reason=f"{CROSS_CC} not installed (gcc-aarch64-linux-gnu)"
    ),
    pytest.mark.skipif(shutil.which(QEMU) is None, reason=f"{QEMU} not installed (qemu-user)"),
    pytest.mark.skipif(shutil.which(B.CC) is None, reason=f"no host {B.CC}"),
    pytest.mark.skipif(
        V.machine_arch() != "x86_64", reason=f"the native builds are for x86-64; this is {platform.machine()}"
    ),
]
"""The module marks of a test that needs the cross toolchain, qemu and a host gcc on x86-64."""


def cross_static() -> bool:
    """Whether the cross toolchain has the static libgomp and libc that a -static link needs."""
    for lib in ("libgomp.a", "libc.a"):
        probe = subprocess.run([CROSS_CC, f"-print-file-name={lib}"], capture_output=True, text=True)
        if probe.returncode != 0 or not Path(probe.stdout.strip()).is_absolute():
            return False
    return True


def sysroot() -> str:
    """The cross toolchain's sysroot, for qemu's -L (the dynamic loader and libraries of a shared link)."""
    probe = subprocess.run([CROSS_CC, "-print-sysroot"], capture_output=True, text=True)
    root = probe.stdout.strip() if probe.returncode == 0 else ""
    return root if root and root != "/" else "/usr/aarch64-linux-gnu"


def harness_env() -> dict[str, str]:
    """The environment for a harness: no inherited OpenMP settings, passive waiting (qemu is slow)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    env.update(OMP_DYNAMIC="false", OMP_WAIT_POLICY="passive")
    return env


def build_harness(
    cc: str, flags: list[str], harness: Path, fast: list[str], out: Path
) -> subprocess.Popen[str]:
    """Starts building the C program `harness` into `out` with the library's flags and `flags`: linked with the
    csrc files `fast` alone first (-ffunction-sections -Wl,--gc-sections drops what the harness does not
    reach), with every csrc file when that does not link. Its output is the build log."""
    base = [cc, *CFLAGS, *flags, f"-I{B.CSRC}", "-o", str(out), str(harness)]
    quick = shlex.join(
        [*base, "-ffunction-sections", "-Wl,--gc-sections", *(str(B.CSRC / f) for f in fast), "-lm"]
    )
    slow = shlex.join([*base, *(str(f) for f in B.source_files()), "-lm"])
    script = f"{quick} 2>/dev/null || {slow}"
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
