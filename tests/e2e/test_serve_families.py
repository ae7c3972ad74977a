"""`izh serve` of the new families through the openai SDK: a Gemma 3 GGUF named by Hub id and pulled
from a local server with the Hub's file API, and the real Gemma 3 270M, each answering exactly what the
offline engine answers on the same prompt."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from izh import LLM, SamplingParams
from tests.conftest import isolated_cache_dir
from tests.e2e.test_serve import START_TIMEOUT_S, Served, _free_port, _wait_for
from tests.fixtures.fake_hub import FakeRepo, serve_fake_hub

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
MAX_TOKENS = 12


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(model: str, env: dict[str, str] | None = None) -> Served:
        port = _free_port()
        log = tmp_path / f"serve-{port}.log"
        full_env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(tmp_path / "cache"), **(env or {})}
        cmd = [
            sys.executable,
            "-m",
            "izh_cli.main",
            "serve",
            model,
            "--port",
            str(port),
            "--dtype",
            "float32",
        ]
        cmd += ["--quantization", "none", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "512"]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        procs.append(proc)
        served = Served(proc, f"http://127.0.0.1:{port}", log)
        _wait_for(
            lambda: served.health() == 200 or proc.poll() is not None, START_TIMEOUT_S * 2, "the server"
        )
        assert proc.poll() is None, log.read_text()
        return served

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def _chat(served: Served) -> tuple[str, int]:
    client = OpenAI(base_url=f"{served.url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.usage.completion_tokens


def _offline(path: str) -> str:
    llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.chat(MESSAGES, params)[0].outputs[0].text


def test_serve_by_hub_id_with_quant(
    start_server: Callable[..., Served], tiny_gguf_factory: Callable[..., str], tmp_path: Path
) -> None:
    q8 = Path(tiny_gguf_factory("gemma3", "Q8_0")).read_bytes()
    repos = {"org/tiny-gemma3-GGUF": FakeRepo({"tiny-gemma3-Q8_0.gguf": q8, "tiny-gemma3-F16.gguf": b"x"})}
    with serve_fake_hub(repos) as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        served = start_server("org/tiny-gemma3-GGUF:Q8_0", env)
        assert "GET /org/tiny-gemma3-GGUF/resolve/main/tiny-gemma3-Q8_0.gguf" in hub.requests
    text, completion_tokens = _chat(served)
    assert completion_tokens >= 1
    assert text == _offline(tiny_gguf_factory("gemma3", "Q8_0"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_serve_real_gemma3(start_server: Callable[..., Served], gemma3_gguf: str) -> None:
    served = start_server(gemma3_gguf)
    text, completion_tokens = _chat(served)
    assert completion_tokens == MAX_TOKENS and text
    assert text == _offline(gemma3_gguf)
