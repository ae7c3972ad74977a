"""Compiling the C kernels: one shared library per variant from every file in `csrc/`, cached on disk.

Build: every `csrc/*.c` (plain C11 + OpenMP, no torch headers; `common.h` shared) is compiled in one gcc
call into one library per variant (izh.kernels.cpu.variants), with
`gcc -O3 -std=c11 -fPIC -shared -fopenmp -ffp-contract=off -fno-math-errno -fno-trapping-math
<the variant's flags>`
(about 3.5 s on a 2-core Xeon for the AVX-512 build, most of it the attention kernel's copies for head
sizes 64 and 128 and the matmuls' copies for each row count). New `.c` files dropped into `csrc/` are
compiled too. The library is cached in the kernels folder (`<model.cache_dir>/kernels`, by default
`~/.cache/izh/kernels`) as `izh_cpu-<variant>-<hash>.so`, the hash covering every file of `csrc/`, the
command, `gcc --version` and the machine (the flags are fixed, so a library is valid on every CPU that
runs its variant); it is built into a temporary file in that folder and moved into place with
`os.replace`, so concurrent builders are safe.

OpenMP runtime: torch's pip wheels bundle their own GNU OpenMP as `torch/lib/libgomp.so.1`, with the
same soname as the system's. Two runtimes in one process would each keep a pool of spinning threads that
fight over the cores, so the library is linked against torch's file itself, with an rpath to its folder.
Its DT_NEEDED is `libgomp.so.1`, which the dynamic loader resolves to the copy torch has already mapped
(checked: /proc/self/maps shows one libgomp after a parallel kernel and a torch matmul, and `ldd` on the
library alone resolves to torch's copy); linking against that file also proves at build time that every
GOMP symbol version the code needs exists there. The kernels' parallel regions thus reuse torch's OpenMP
thread pool. Without a bundled libgomp (a torch built against the system's), or if linking against it
fails, the plain `-fopenmp` link is used; the loader's soname match still shares whichever
`libgomp.so.1` torch loaded first. A torch built with Intel OpenMP (libiomp5) would get a second runtime:
the kernels still work but their threads compete with torch's.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from izh.kernels.cpu.variants import cpu_flags, get_variant, select_variant

__all__ = ["CSRC", "BuildResult", "build", "compile_command", "default_cache_dir", "source_files"]

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
"""The C sources: every `*.c` here goes into the library; `*.h` files are included by them."""
CC = "gcc"
BASE_CFLAGS = (
    "-O3",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-fopenmp",
    "-ffp-contract=off",  # rotary must round each product on its own, as torch does
    "-fno-math-errno",
    # Nothing reads the FP exception flags; without this gcc will not if-convert exp_f32's clamps, and
    # every loop over it (SiLU, softmax, sampling) stays scalar. Results are unchanged.
    "-fno-trapping-math",
)


@dataclass(frozen=True)
class BuildResult:
    """What `build` did: `path` is the library (None when there is none), `compiled` False when it came
    from the cache, `seconds` the compile time, `error` why there is no library."""

    path: Path | None
    compiled: bool = False
    seconds: float = 0.0
    error: str | None = None


def default_cache_dir() -> Path:
    """The kernels folder when nothing is configured: `<model.cache_dir>/kernels` with model.cache_dir from
    the environment (IZH_MODEL__CACHE_DIR, else IZH_CACHE_DIR, else ~/.cache/izh)."""
    from izh.settings import env_cache_dir

    return env_cache_dir() / "kernels"


def source_files(source_dir: Path | None = None) -> list[Path]:
    """The `.c` files of `source_dir` (default `CSRC`) compiled into the library, sorted by name."""
    return sorted((source_dir or CSRC).glob("*.c"))


def _torch_libgomp() -> str | None:
    """torch's bundled GNU OpenMP runtime (pip wheels ship `torch/lib/libgomp*.so*`), if any."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    return found[0] if found else None


def compile_command(
    variant: str,
    output: str,
    sources: list[str],
    *,
    compiler: str = CC,
    machine: str | None = None,
    torch_gomp: bool = True,
) -> list[str]:
    """The compiler command that builds `variant` (for `machine`, default this one) from `sources`."""
    flags = get_variant(variant, machine).cflags
    cmd = [compiler, *BASE_CFLAGS, *flags, "-o", output, *sources]
    gomp = _torch_libgomp() if torch_gomp else None
    if gomp is not None:
        # Resolve the GOMP symbols against torch's runtime (the one already mapped in this process).
        cmd += [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"]
    return [*cmd, "-lm"]


def _compiler_version(compiler: str) -> str:
    try:
        run = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    lines = run.stdout.splitlines()
    return lines[0] if lines else ""


def _cache_key(variant: str, compiler: str, source_dir: Path) -> str:
    key = hashlib.sha256()
    files = sorted([*source_dir.glob("*.c"), *source_dir.glob("*.h")])
    parts = [path.name.encode() + b"\0" + path.read_bytes() for path in files]
    parts += [
        "\0".join(compile_command(variant, "<out>", ["<src>"], compiler=compiler)).encode(),
        _compiler_version(compiler).encode(),
        platform.machine().encode(),
    ]
    for part in parts:
        key.update(part)
        key.update(b"\x1e")
    return key.hexdigest()[:20]


def build(
    cache_dir: Path | str | None = None,
    compiler: str = CC,
    *,
    variant: str | None = None,
    source_dir: Path | None = None,
) -> BuildResult:
    """Compile `source_dir/*.c` (default `CSRC`) as `variant` into
    `<cache_dir>/izh_cpu-<variant>-<hash>.so`, or reuse the cached one. Never raises.

    cache_dir (the kernels folder itself) defaults to `default_cache_dir()`; variant to the best one this
    CPU runs. Whether this CPU can run a given variant is the caller's business (`select_variant`): the
    build itself works on any."""
    if variant is None:
        variant = select_variant("auto", cpu_flags()).variant
    exe = shutil.which(compiler)
    if exe is None:
        return BuildResult(None, error=f"no C compiler ({compiler!r} not on PATH)")
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    source_dir = source_dir or CSRC
    sources = [str(path) for path in source_files(source_dir)]
    try:
        if not sources:
            raise OSError(f"no .c files in {source_dir}")
        target = folder / f"izh_cpu-{variant}-{_cache_key(variant, exe, source_dir)}.so"
    except (OSError, ValueError) as exc:
        return BuildResult(None, error=f"cannot read the sources: {exc}")
    if target.is_file():
        return BuildResult(target)

    tmp: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".izh_cpu-{variant}-", suffix=".so.tmp")
        os.close(fd)
        start = time.perf_counter()
        run = subprocess.run(
            compile_command(variant, tmp, sources, compiler=exe),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=folder,
        )
        if run.returncode != 0 and _torch_libgomp() is not None:
            # Linking against torch's libgomp failed: try the system runtime (the loader still shares
            # torch's copy by soname when torch's is mapped first).
            plain = subprocess.run(
                compile_command(variant, tmp, sources, compiler=exe, torch_gomp=False),
                capture_output=True,
                text=True,
                timeout=300,
                cwd=folder,
            )
            if plain.returncode == 0:
                logger.debug("linking against torch's libgomp failed, used the system one:\n%s", run.stderr)
                run = plain
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            tail = (run.stderr or run.stdout)[-2000:]
            return BuildResult(None, compiled=True, seconds=seconds, error=f"compile failed:\n{tail}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        tmp = None
        logger.debug("built %s in %.2f s", target, seconds)
        return BuildResult(target, compiled=True, seconds=seconds)
    except (OSError, subprocess.SubprocessError) as exc:
        return BuildResult(None, error=f"build failed: {exc}")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
