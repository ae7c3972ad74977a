"""Models by Hugging Face Hub id: ``org/repo`` (the repo's safetensors folder, or its GGUF) and
``org/repo:QUANT`` (the GGUF file of that quantization, as llama-server's ``-hf`` picks it).

Files come through ``huggingface_hub`` (HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE honoured, its progress
bars on stderr) into ``<cache_dir>/hub`` in the Hub's own cache layout, so a second pull costs one
metadata request, and none with ``download=False``. huggingface_hub is imported only here.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from izh.errors import ModelDownloadError, ModelNotFound, UnsupportedModel

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?")
DEFAULT_QUANT = "Q4_K_M"
"""The quantization picked from a GGUF-only repo when none is asked (llama-server's default too)."""
_FOLDER_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
"""What a Hugging Face model folder needs: config, weights, tokenizer files and templates."""


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, quant or None) for ``org/repo`` / ``org/repo:QUANT``; None for anything else."""
    match = _HUB_ID.fullmatch(name)
    if match is None:
        return None
    return match.group("repo"), match.group("quant")


def pick_gguf(repo_id: str, files: list[str], quant: str | None) -> str:
    """The GGUF file of ``quant`` (case-insensitive, as a whole name part) among a repo's files; a
    vision projector (mmproj) is never the model. Raises ModelNotFound listing the repo's GGUF files."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    wanted = (quant or DEFAULT_QUANT).lower()
    # The quant as a whole name part: "Q4_K" is not "Q4_K_M" (a "_" after it continues the quant).
    part = re.compile(rf"(^|[^a-z0-9]){re.escape(wanted)}([^a-z0-9_]|$)")
    matches = [f for f in ggufs if part.search(f.rsplit("/", 1)[-1].lower())]
    if matches:
        split = re.search(r"-\d+-of-(\d+)\.gguf$", matches[0])
        if split is not None:
            raise UnsupportedModel(
                f"{repo_id}: {matches[0]} is split into {int(split.group(1))} files, which izh does not load; "
                "merge them with llama.cpp's gguf-split --merge and serve the merged file"
            )
        return matches[0]
    if quant is None and ggufs:
        return ggufs[0]
    have = ", ".join(f.rsplit("/", 1)[-1] for f in ggufs) or "none"
    raise ModelNotFound(
        f"{repo_id} has no GGUF file for {quant or DEFAULT_QUANT!r}; its GGUF files: {have}", param="model"
    )


def pull_hub_model(repo_id: str, quant: str | None, cache_dir: Path, *, download: bool = True) -> Path:
    """The local path of a Hub model (a .gguf file, or a folder with config.json), downloaded first
    unless ``download`` is false (then only what the cache holds). Raises ModelNotFound for a missing
    repo or file, ModelDownloadError for a gated repo or a network failure, UnsupportedModel for a repo
    holding neither GGUF files nor a config.json."""
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    hub_cache = Path(cache_dir).expanduser() / "hub"
    try:
        if not download:
            return _cached(repo_id, quant, hub_cache)
        files = huggingface_hub.list_repo_files(repo_id)
        if quant is not None or "config.json" not in files:
            if quant is None and not any(f.lower().endswith(".gguf") for f in files):
                raise UnsupportedModel(
                    f"{repo_id} holds neither GGUF files nor a config.json, so it is not a model izh can load"
                )
            filename = pick_gguf(repo_id, files, quant)
            logger.info("downloading %s from %s", filename, repo_id)
            return Path(huggingface_hub.hf_hub_download(repo_id, filename, cache_dir=hub_cache))
        logger.info("downloading the model folder of %s", repo_id)
        folder = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=_FOLDER_PATTERNS, cache_dir=hub_cache
        )
        return Path(folder)
    except hub_errors.GatedRepoError as exc:
        raise ModelDownloadError(
            f"{repo_id} is a gated repository and this request was refused ({_status(exc)}): accept its "
            "license on the Hub, then set HF_TOKEN to a token of that account"
        ) from None
    except hub_errors.RepositoryNotFoundError as exc:
        raise ModelNotFound(
            f"no repository {repo_id} on {huggingface_hub.constants.ENDPOINT} ({_status(exc)}); "
            "check the id, or set HF_TOKEN if it is private",
            param="model",
        ) from None
    except hub_errors.EntryNotFoundError as exc:
        raise ModelNotFound(f"{repo_id}: {exc}", param="model") from None
    except (hub_errors.HfHubHTTPError, OSError) as exc:
        raise ModelDownloadError(f"could not download {repo_id} from the Hub: {exc}") from None


def _cached(repo_id: str, quant: str | None, hub_cache: Path) -> Path:
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    if quant is None:
        try:
            return Path(
                huggingface_hub.snapshot_download(
                    repo_id, allow_patterns=_FOLDER_PATTERNS, cache_dir=hub_cache, local_files_only=True
                )
            )
        except hub_errors.LocalEntryNotFoundError:
            pass  # not cached as a folder; maybe as a GGUF file
    snapshots = hub_cache / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    files = [str(p.relative_to(s)) for s in snapshots.glob("*") for p in s.rglob("*.gguf")]
    if files:
        name = pick_gguf(repo_id, files, quant)
        for snapshot in snapshots.glob("*"):
            if (snapshot / name).is_file():
                return snapshot / name
    raise ModelNotFound(
        f"{repo_id} is not in the cache ({hub_cache}); run `izh pull {repo_id}` first.", param="model"
    )


def _status(exc: Any) -> str:
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return f"HTTP {code}" if code is not None else type(exc).__name__
