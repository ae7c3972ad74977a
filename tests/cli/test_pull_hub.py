"""`izh pull org/repo[:QUANT]` through the real huggingface_hub client against a local server with the
Hub's file API (HF_ENDPOINT), HF_TOKEN for a gated repo, and clear errors for what cannot be pulled."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from izh.errors import ModelNotFound, UnsupportedModel
from izh.hub import resolve_model
from izh.hub_remote import parse_hub_id, pick_gguf
from tests.fixtures.fake_hub import FakeHub, FakeRepo, serve_fake_hub

TOKEN = "hf_test_token"
Q4 = b"GGUF q4_k_m bytes" * 100
Q8 = b"GGUF q8_0 bytes" * 100


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    repos = {
        "org/tiny-GGUF": FakeRepo(
            {
                "README.md": b"# tiny",
                "tiny-Q4_K_M.gguf": Q4,
                "tiny-Q8_0.gguf": Q8,
                "mmproj-tiny-Q8_0.gguf": b"projector",
            }
        ),
        "org/tiny": FakeRepo(
            {
                "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
                "model.safetensors": b"w",
                "README.md": b"x",
            }
        ),
        "org/gated-GGUF": FakeRepo({"gated-Q8_0.gguf": Q8}, gated_token=TOKEN),
    }
    with serve_fake_hub(repos) as served:
        yield served


def izh_pull(
    hub: FakeHub, name: str, cache: Path, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(cache / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    if token is not None:
        env["HF_TOKEN"] = token
    cmd = [sys.executable, "-m", "izh_cli.main", "pull", name, "--cache-dir", str(cache)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_quant_picks_the_gguf_file(hub: FakeHub, tmp_path: Path) -> None:
    result = izh_pull(hub, "org/tiny-GGUF:q8_0", tmp_path)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == Q8
    assert path.is_relative_to(tmp_path / "hub")
    assert "GET /org/tiny-GGUF/resolve/main/tiny-Q8_0.gguf" in hub.requests
    # Pulled: resolving without download finds it in the cache (no request), a missing quant does not.
    requests = len(hub.requests)
    assert resolve_model("org/tiny-GGUF:Q8_0", tmp_path, download=False) == path
    assert len(hub.requests) == requests
    with pytest.raises(ModelNotFound, match="no GGUF file for 'Q4_K_M'"):
        resolve_model("org/tiny-GGUF:Q4_K_M", tmp_path, download=False)


def test_gguf_repo_without_a_quant_gets_q4_k_m(hub: FakeHub, tmp_path: Path) -> None:
    result = izh_pull(hub, "org/tiny-GGUF", tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip().splitlines()[-1]).read_bytes() == Q4


def test_folder_repo_is_pulled_as_a_folder(hub: FakeHub, tmp_path: Path) -> None:
    result = izh_pull(hub, "org/tiny", tmp_path)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert resolve_model("org/tiny", tmp_path, download=False) == folder


def test_gated_repo_needs_hf_token(hub: FakeHub, tmp_path: Path) -> None:
    refused = izh_pull(hub, "org/gated-GGUF:Q8_0", tmp_path)
    assert refused.returncode == 1
    message = " ".join(refused.stderr.split())
    assert "org/gated-GGUF is a gated repository" in message and "HTTP 401" in message
    assert "HF_TOKEN" in message
    allowed = izh_pull(hub, "org/gated-GGUF:Q8_0", tmp_path, token=TOKEN)
    assert allowed.returncode == 0, allowed.stderr
    assert Path(allowed.stdout.strip().splitlines()[-1]).read_bytes() == Q8


def test_missing_quant_lists_the_files(hub: FakeHub, tmp_path: Path) -> None:
    result = izh_pull(hub, "org/tiny-GGUF:Q5_K_S", tmp_path)
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert "org/tiny-GGUF has no GGUF file for 'Q5_K_S'" in message
    assert "tiny-Q4_K_M.gguf, tiny-Q8_0.gguf" in message and "mmproj" not in message


def test_unknown_repo(hub: FakeHub, tmp_path: Path) -> None:
    result = izh_pull(hub, "org/nothing", tmp_path)
    assert result.returncode == 1
    assert "no repository org/nothing" in " ".join(result.stderr.split())


def test_hub_ids_and_quant_matching() -> None:
    assert parse_hub_id("org/repo") == ("org/repo", None)
    assert parse_hub_id("unsloth/gemma-3-270m-it-GGUF:Q4_K_M") == ("unsloth/gemma-3-270m-it-GGUF", "Q4_K_M")
    assert parse_hub_id("smollm2") is None and parse_hub_id("./a/b/c") is None
    files = [
        "m-Q4_K_M.gguf",
        "m-Q4_K_S.gguf",
        "m-Q4_0.gguf",
        "big-Q8_0-00001-of-00002.gguf",
        "big-Q8_0-00002-of-00002.gguf",
    ]
    with pytest.raises(ModelNotFound, match="no GGUF file for 'Q4_K'"):
        pick_gguf("r", files, "Q4_K")
    assert pick_gguf("r", files, "q4_0") == "m-Q4_0.gguf"
    with pytest.raises(UnsupportedModel, match="split into 2 files"):
        pick_gguf("r", files, "Q8_0")
