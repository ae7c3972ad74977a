"""benchmarks/gpu_check.py: its correctness half on CUDA (marked gpu), and its dry run on a CPU.

The GPU tests call the check's own functions (the Triton kernels against float64, SmolLM2's float32 greedy
tokens on CUDA against the CPU, CUDA-graph replay against eager at every captured batch size), so
`pytest -m gpu tests/gpu` and `just gpu-check` cannot disagree on what "correct" means. The CPU test runs the
whole script's dry run on a tiny random checkpoint, so that the script cannot rot where no GPU ever runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from izh.kernels.paged_attention import is_available

ROOT = Path(__file__).resolve().parents[2]
needs_gpu = pytest.mark.skipif(not is_available(), reason="needs CUDA and triton")


@pytest.mark.gpu
@needs_gpu
def test_triton_kernels_match_float64_in_float32_and_bf16() -> None:
    results = gpu_check.check_kernels("cuda", small=False)
    assert all("passed" in r for r in results), [r for r in results if "passed" not in r]
    assert {r["dtype"] for r in results} == {"float32", "bfloat16"}
    failed = [r for r in results if not r["passed"]]
    assert not failed, json.dumps(failed, indent=1)


@pytest.mark.gpu
@needs_gpu
def test_smollm2_float32_greedy_tokens_on_cuda_equal_cpu(smollm2_gguf: str) -> None:
    result = gpu_check.check_parity(gpu_check.make_context("cuda", smollm2_gguf))
    assert result["prompts"][0]["length"] == gpu_check.FULL.parity_tokens
    assert result["passed"], json.dumps(result["prompts"])


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_replay_equals_eager_at_every_captured_size(smollm2_gguf: str) -> None:
    result = gpu_check.check_graphs(gpu_check.make_context("cuda", smollm2_gguf))
    assert result["captured_sizes"], "the CUDA engine captured no graphs"
    assert result["captured_but_not_replayed"] == []
    assert result["passed"], json.dumps(result["batches"])


def test_dry_run_of_every_phase_on_a_tiny_checkpoint(tiny_llama_dir: str, tmp_path: Path) -> None:
    """The script end to end on a CPU (kernels under Triton's interpreter, one attention case): every phase
    runs and records its results, the correctness checks pass, and the targets are reported, not judged."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = ["--device", "cpu", "--dry-run", "--model", tiny_llama_dir, "--cases", "decode-padded"]
    argv += ["--out", str(out), "--log-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "gpu_check" and record["dry_run"] is True
    assert record["machine"]["torch"] and "git_sha" in record and "command" in record
    phases = record["phases"]
    assert list(phases) == list(gpu_check.PHASES)
    assert {name: p["status"] for name, p in phases.items()} == dict.fromkeys(gpu_check.PHASES, "ok")

    kernels = phases["kernels"]
    assert kernels["interpreter"] and kernels["passed"]
    ran = {(c["name"], c["dtype"]) for c in kernels["cases"] if "passed" in c}
    assert ran == {
        ("decode-padded", "float32"),
        ("write_kv_cache", "float32"),
        ("write_kv_cache", "bfloat16"),
    }
    assert phases["parity"]["passed"] and "harness check only" in phases["parity"]["note"]
    assert len(phases["parity"]["tokens_device"][0]) == gpu_check.DRY.parity_tokens
    graphs = phases["graphs"]
    assert graphs["passed"] and [b["batch"] for b in graphs["batches"]] == [1, 2, 3, 4]
    assert phases["attention"]["shapes"]["smollm2 9/3x64"]["kv_bytes"] > 0
    offline = phases["offline"]["levels"]
    assert [lv["concurrency"] for lv in offline] == list(gpu_check.DRY.levels)
    assert all(lv["output_tokens"] == lv["concurrency"] * gpu_check.DRY.output_len for lv in offline)
    served = phases["server"]["levels"]
    assert [(lv["completed"], lv["failed"]) for lv in served] == [(1, 0), (2, 0)]

    verdicts = {t["target"]: t["verdict"] for t in record["targets"]}
    assert [verdicts[f"correctness: {name}"] for name in ("kernels", "parity", "graphs")] == ["PASS"] * 3
    speed = [v for name, v in verdicts.items() if not name.startswith("correctness")]
    assert len(speed) == 4 and all(v.startswith("n/a (dry run") for v in speed)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-8].startswith("target") and lines[-1].startswith("decode attention")  # the table, last
