"""A real `izh serve` of the default model (SmolLM2-135M-Instruct GGUF) for the client contract tests:
one subprocess with its spawned engine core on a free loopback port, started once per test module:

    @pytest.fixture(scope="module")
    def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
        yield from serve_default_model(smollm2_gguf, tmp_path_factory)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import isolated_cache_dir
from tests.e2e.test_serve import START_TIMEOUT_S, _free_port, _wait_for

MODEL = "smollm2"
API_KEY = "test-key"


@dataclass(frozen=True)
class RealServer:
    """A running server: `url` is its root (no /v1), `model` the name it serves under."""

    url: str
    model: str
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def serve_default_model(
    smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory, extra_args: tuple[str, ...] = ()
) -> Iterator[RealServer]:
    """`izh serve` of the default model under the name `smollm2`, behind API_KEY (plus `extra_args`), for
    a module-scoped fixture to `yield from`; stopped (SIGTERM, then kill) when the fixture ends."""
    folder = tmp_path_factory.mktemp("real-server")
    port = _free_port()
    log = folder / "serve.log"
    env = {**os.environ, "IZH_CACHE_DIR": isolated_cache_dir(folder / "cache")}
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", smollm2_gguf, "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--max-model-len", "2048", "--kv-cache-memory-bytes", "128MiB"]
    cmd += ["--api-key", API_KEY, *extra_args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: proc.poll() is not None or _health(url) == 200, START_TIMEOUT_S, "izh serve")
        assert proc.poll() is None, log.read_text()
        yield RealServer(url=url, model=MODEL, log=log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
