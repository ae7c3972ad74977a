"""`izh serve --tensor-parallel-size 2` over real HTTP, on the tiny Llama in float32: one host (rank 0
starts rank 1 itself), and two separate `izh serve` processes joined on loopback as two hosts would be
(`--nnodes 2 --node-rank 0|1 --dist-init-addr`). Greedy completions equal the offline TP=1 engine's; rank
0's SIGTERM stops the worker host cleanly; a killed worker fails the next request with engine_dead
naming the tensor-parallel failure, and rank 0 exits 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from izh.llm import LLM
from izh.sampling_params import SamplingParams
from tests.conftest import isolated_cache_dir
from tests.e2e.test_serve import START_TIMEOUT_S, _free_port, _wait_for

PROMPTS = ["hello world", "the quick brown fox jumps"]
MAX_TOKENS = 10
COMMON = ["--dtype", "float32", "--kv-cache-memory-bytes", "8MiB", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str) -> list[str]:
    """The offline TP=1 engine's greedy texts."""
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


def _start(args: list[str], log: Path, cache: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(cache)}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "izh_cli.main", "serve", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _completions(url: str) -> list[str]:
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, _strict_response_validation=True
    )
    texts = []
    for prompt in PROMPTS:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        texts.append(out.choices[0].text)
    return texts


@pytest.fixture
def two_hosts(
    tiny_llama_dir: str, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes], Path]]:
    """Rank 0 (`izh serve`, serving) and rank 1 (`izh serve --node-rank 1`, a worker) as two processes."""
    port, dist_port = _free_port(), _free_port()
    dist = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist_port}"]
    rank0 = _start(
        [tiny_llama_dir, *COMMON, *dist, "--node-rank", "0", "--port", str(port)],
        tmp_path / "r0.log",
        tmp_path / "c0",
    )
    rank1 = _start([tiny_llama_dir, *COMMON, *dist, "--node-rank", "1"], tmp_path / "r1.log", tmp_path / "c1")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: rank0.poll() is not None or _ready(url), START_TIMEOUT_S, "rank 0 ready")
        assert rank0.poll() is None, (tmp_path / "r0.log").read_text()
        yield url, rank0, rank1, tmp_path
    finally:
        _stop(rank0)
        _stop(rank1)


def test_one_host_serves_tp2_with_the_tp1_greedy_texts(
    tiny_llama_dir: str, expected: list[str], tmp_path: Path
) -> None:
    port = _free_port()
    proc = _start(
        [tiny_llama_dir, *COMMON, "--tensor-parallel-size", "2", "--port", str(port)],
        tmp_path / "serve.log",
        tmp_path / "c",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: proc.poll() is not None or _ready(url), START_TIMEOUT_S, "izh serve ready")
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        assert _completions(url) == expected
    finally:
        _stop(proc)
    assert proc.returncode == 0
    log = (tmp_path / "serve.log").read_text()
    assert "tensor-parallel rank 1: shutdown from rank 0" in log  # the worker rank left on rank 0's word


def test_two_processes_joined_on_loopback_serve_the_tp1_greedy_texts(
    two_hosts: tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes], Path], expected: list[str]
) -> None:
    url, rank0, rank1, folder = two_hosts
    assert _completions(url) == expected
    rank0.send_signal(signal.SIGTERM)
    assert rank0.wait(60) == 0
    assert rank1.wait(60) == 0, (folder / "r1.log").read_text()  # the shutdown plan, not a lost peer
    assert "shutdown from rank 0" in (folder / "r1.log").read_text()


def test_a_killed_worker_host_fails_the_next_request_and_rank_0_exits_1(
    two_hosts: tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes], Path],
) -> None:
    url, rank0, rank1, folder = two_hosts
    assert len(_completions(url)) == len(PROMPTS)
    rank1.kill()
    rank1.wait()
    response = httpx.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "engine_dead" and "tensor-parallel" in error["message"]
    assert rank0.wait(60) == 1
    assert "tensor-parallel collective failed" in (folder / "r0.log").read_text()


def test_hosts_that_disagree_on_the_model_fail_to_start_saying_so(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    port, dist_port = _free_port(), _free_port()
    dist = ["--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist_port}"]
    rank0 = _start(
        [tiny_llama_dir, *COMMON, *dist, "--node-rank", "0", "--port", str(port)],
        tmp_path / "r0.log",
        tmp_path / "c0",
    )
    rank1 = _start(
        [tiny_llama_dir, *COMMON, *dist, "--node-rank", "1", "--block-size", "32"],
        tmp_path / "r1.log",
        tmp_path / "c1",
    )
    try:
        assert rank0.wait(START_TIMEOUT_S) == 1
        assert rank1.wait(START_TIMEOUT_S) != 0
    finally:
        _stop(rank0)
        _stop(rank1)
    assert "the tensor-parallel ranks disagree on the model" in (tmp_path / "r0.log").read_text()
