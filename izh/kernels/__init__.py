"""Triton kernels, one a file, each with the plain torch reference that defines it.

Triton is an optional extra (`izh[gpu]`): it is imported only when a kernel first runs, so this package
imports on a CPU-only install. `is_available()` says whether the kernels can run on a GPU here.
"""

from __future__ import annotations

from izh.kernels.paged_attention import is_available

__all__ = ["is_available"]
