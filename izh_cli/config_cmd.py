"""`izh config show`: print the settings as resolved from defaults, file, IZH_* environment and flags."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from izh.settings import settings_flag_specs
from izh_cli._common import ConfigOption, load_cli_settings, with_settings_flags

config_app = typer.Typer(
    name="config",
    help="Inspect configuration.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_line(key: str, value: Any, secret: bool) -> str:
    if value is None:
        return f"# {key}: unset"
    if secret and value:
        # A comment, not the mask: pasting this output into a config file must not set a bogus key.
        return f"# {key}: {len(value)} set (hidden)"
    return f"{key} = {_toml_value(value)}"


def render_toml(sections: dict[str, dict[str, Any]], secret_keys: frozenset[str] = frozenset()) -> str:
    """TOML text for ``{section: {key: value}}``, a valid config file.

    An unset (None) value becomes a comment line, and so does a non-empty secret (dotted key in
    ``secret_keys``), so that secrets are never written out.
    """
    blocks = []
    for section, values in sections.items():
        lines = [f"[{section}]"]
        lines += [_toml_line(key, value, f"{section}.{key}" in secret_keys) for key, value in values.items()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


@config_app.command("show")
@with_settings_flags
def show(
    model: Annotated[
        str | None,
        typer.Argument(help="Model (registry name, .gguf file or Hugging Face folder); sets model.name."),
    ] = None,
    config: ConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML.")] = False,
    *,
    settings_overrides: dict[str, Any],
) -> None:
    """Print the resolved settings (defaults < --config file < IZH_* environment < flags).

    API keys are never shown. The TOML output is a valid config file.
    """
    settings = load_cli_settings(config, settings_overrides, model=model)
    data = settings.to_display_dict()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    secret_keys = frozenset(spec.dotted for spec in settings_flag_specs() if spec.secret)
    typer.echo(render_toml(data, secret_keys), nl=False)
