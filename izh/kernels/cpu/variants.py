"""The instruction-set variants of the C kernels, and which one a CPU runs (pure functions of its flags).

Each variant is the whole library compiled with fixed flags (no `-march=native`, so a cached library is
valid on every CPU that has the variant's flags):

| variant | machine | compiler flags | CPU flags needed |
|---|---|---|---|
| generic | x86_64 | -march=x86-64 -mtune=generic | none |
| avx2 | x86_64 | -march=x86-64-v3 -mtune=generic | x86-64-v3: avx2 fma f16c bmi1 bmi2 ... |
| avx512 | x86_64 | -march=x86-64-v4 -mavx512bf16 -mavx512vnni -mprefer-vector-width=512 | v3 + avx512f bw cd dq vl, avx512_bf16, avx512_vnni |
| amx | x86_64 | avx512's + -mamx-tile -mamx-bf16 -mamx-int8 | avx512's + amx_tile amx_bf16 (AMX-INT8, which the GGUF block matmuls use, is checked at run time) |
| generic | aarch64 | -march=armv8-a (NEON included) | none |
| neon | aarch64 | -march=armv8.2-a+dotprod | asimd asimddp (SDOT: the GGUF block matmuls' dot products) |

On any other machine `generic` is built with no `-march` flag. A CPU with AVX-512 but no AVX512-BF16
gets `avx2`: the AVX-512 code paths (record matmuls, bf16 attention scores, argmax) need BF16. An ARMv8
CPU without dotprod (Cortex-A53/A72) gets aarch64's `generic`, which has NEON too (armv8-a includes it):
the same NEON record tiles, and SMULL + SADALP in place of SDOT in the GGUF block matmuls. The flags
are the words of /proc/cpuinfo's `flags` (x86) or `Features` (aarch64) line.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "VARIANTS",
    "VARIANT_NAMES",
    "Selection",
    "Variant",
    "cpu_flags",
    "get_variant",
    "machine_arch",
    "missing_flags",
    "runnable_variants",
    "select_variant",
]


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the library: `cflags` replace `-march=native`; a CPU runs it when it has every flag
    in `requires` (and its machine is `arch`). `shown` are the flags a log line names."""

    name: str
    arch: str
    cflags: tuple[str, ...]
    requires: frozenset[str]
    shown: tuple[str, ...] = ()


_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_AVX512 = _X86_V4 | {"avx512_bf16", "avx512_vnni"}
_AVX512_FLAGS = (
    "-march=x86-64-v4",
    "-mtune=generic",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mprefer-vector-width=512",
)

# Best first within each machine (the order runnable_variants reports).
_TABLE: tuple[Variant, ...] = (
    Variant(
        "amx",
        "x86_64",
        (*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
        _AVX512 | {"amx_tile", "amx_bf16"},
        ("amx_tile", "amx_bf16", "avx512_bf16"),
    ),
    Variant("avx512", "x86_64", _AVX512_FLAGS, _AVX512, ("avx512f", "avx512bw", "avx512_bf16")),
    Variant("avx2", "x86_64", ("-march=x86-64-v3", "-mtune=generic"), _X86_V3, ("avx2", "fma", "f16c")),
    Variant("generic", "x86_64", ("-march=x86-64", "-mtune=generic"), frozenset()),
    Variant(
        "neon",
        "aarch64",
        ("-march=armv8.2-a+dotprod",),
        frozenset({"asimd", "asimddp"}),
        ("asimd", "asimddp"),
    ),
    Variant("generic", "aarch64", ("-march=armv8-a",), frozenset()),
)

VARIANT_NAMES: tuple[str, ...] = ("generic", "avx2", "avx512", "amx", "neon")
"""Every variant name, as `engine.cpu_kernels` takes them (besides auto and off)."""

VARIANTS: dict[tuple[str, str], Variant] = {(v.arch, v.name): v for v in _TABLE}
"""Keyed by (machine, name): `generic` exists on every machine, the others on one."""


def machine_arch(machine: str | None = None) -> str:
    """The machine as this table names it: x86_64, aarch64, or platform.machine() lowercased."""
    raw = (machine if machine is not None else platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(raw, raw)


def cpu_flags() -> frozenset[str]:
    """This CPU's flags: the first `flags` or `Features` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def get_variant(name: str, machine: str | None = None) -> Variant:
    """The variant `name` for `machine` (default: this one); `generic` exists everywhere.

    Raises ValueError for an unknown name or one that belongs to another machine."""
    arch = machine_arch(machine)
    if name not in VARIANT_NAMES:
        raise ValueError(f"unknown CPU kernel variant {name!r}; known: {', '.join(VARIANT_NAMES)}")
    found = VARIANTS.get((arch, name))
    if found is not None:
        return found
    if name == "generic":  # a machine the table does not know: the compiler's own default target
        return Variant("generic", arch, (), frozenset())
    other = next(v.arch for v in _TABLE if v.name == name)
    raise ValueError(f"the {name} variant is for {other} CPUs; this machine is {arch}")


def missing_flags(name: str, flags: Iterable[str] | None = None, machine: str | None = None) -> list[str]:
    """The CPU flags variant `name` needs that `flags` (default: this CPU's) lacks; empty when it runs."""
    have = cpu_flags() if flags is None else frozenset(flags)
    return sorted(get_variant(name, machine).requires - have)


def runnable_variants(flags: Iterable[str] | None = None, machine: str | None = None) -> list[str]:
    """Every variant a CPU with `flags` (default: this CPU's) on `machine` (default: this one) can execute,
    best first (`generic` always last)."""
    arch = machine_arch(machine)
    have = cpu_flags() if flags is None else frozenset(flags)
    names = [v.name for v in _TABLE if v.arch == arch and v.requires <= have]
    return names or ["generic"]


@dataclass(frozen=True, slots=True)
class Selection:
    """The variant in force and a short reason for the log ("this CPU has avx2 fma f16c, no avx512f")."""

    variant: str
    reason: str


def select_variant(
    requested: str, flags: Iterable[str] | None = None, machine: str | None = None
) -> Selection:
    """The variant for `requested` (auto, or a variant name) on a CPU with `flags` (default: this CPU's).

    auto takes the best runnable variant; a name is taken as asked. Raises ValueError, naming the
    missing flags, for a variant this CPU cannot run (or an unknown name, or another machine's)."""
    have = cpu_flags() if flags is None else frozenset(flags)
    runnable = runnable_variants(have, machine)
    if requested != "auto":
        lacking = missing_flags(requested, have, machine)
        if lacking:
            raise ValueError(
                f"this CPU cannot run the {requested} variant of the C kernels: it lacks "
                f"{' '.join(lacking)} (runnable here: {', '.join(runnable)})"
            )
        return Selection(requested, "asked for by engine.cpu_kernels")
    best = get_variant(runnable[0], machine)
    parts = [f"this CPU has {' '.join(best.shown)}"] if best.shown else []
    arch_table = [v for v in _TABLE if v.arch == best.arch]
    better = arch_table[: arch_table.index(best)] if best in arch_table else []
    if better:
        # The next better variant's missing flags, the ones its log line names first.
        nearest = better[-1]
        lacking = [f for f in nearest.shown if f not in have] or sorted(nearest.requires - have)
        parts.append(f"no {' '.join(lacking[:3])}")
    elif not arch_table:
        parts.append(f"no tuned variant for {best.arch}")
    return Selection(best.name, ", ".join(parts) or "the best variant for this CPU")
