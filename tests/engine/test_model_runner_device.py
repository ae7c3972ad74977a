"""ModelRunner's device plumbing that must hold on CUDA, checked where it can be on a CPU."""

from __future__ import annotations

import torch

from izh.engine.model_runner import cpu_kernels_for
from izh.engine.sampler import to_device


def test_cuda_engines_turn_the_cpu_kernels_off_unless_a_variant_is_named() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cpu_kernels_for(cuda, None) == "off"
    assert cpu_kernels_for(cuda, "auto") == "off"
    assert cpu_kernels_for(cuda, " AUTO ") == "off"
    assert cpu_kernels_for(cuda, "avx2") == "avx2"  # named: kept (and checked) as asked
    assert cpu_kernels_for(cpu, None) is None
    assert cpu_kernels_for(cpu, "auto") == "auto"
    assert cpu_kernels_for(cpu, "off") == "off"


def test_to_device_leaves_cpu_tensors_alone() -> None:
    host = torch.arange(5)
    assert to_device(host, torch.device("cpu")) is host
