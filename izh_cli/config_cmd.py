"""`izh config show`: print the settings as resolved from defaults, file, IZH_* environment and flags."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from izh.settings import IzhSettings, settings_flag_specs
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
    """Print the resolved settings (defaults < --config file < IZH_* environment < flags), then what they
    resolve to on this machine: the C kernel variant and the dtype `auto` gives.

    API keys are never shown. The TOML output is a valid config file (the machine's part is comments).
    """
    settings = load_cli_settings(config, settings_overrides, model=model)
    data = settings.to_display_dict()
    here = resolved_here(settings)
    if as_json:
        typer.echo(json.dumps({**data, "resolved_here": here}, indent=2))
        return
    secret_keys = frozenset(spec.dotted for spec in settings_flag_specs() if spec.secret)
    typer.echo(render_toml(data, secret_keys), nl=False)
    typer.echo("\n# On this machine:")
    for key, value in here.items():
        typer.echo(f"#   {key}: {value}")


def resolved_here(settings: IzhSettings) -> dict[str, str]:
    """What the engine would put in force on this machine for `settings`, without loading anything:
    the C kernel variant (and why), the dtype `model.dtype` resolves to and the KV cache format (with
    tokens per GiB for a model already on this machine)."""
    import shutil

    from izh.engine.model_runner import resolve_device, resolve_dtype
    from izh.errors import ModelLoadError
    from izh.kernels.cpu import select_variant

    requested = settings.engine.cpu_kernels
    if requested == "off":
        kernels = "off (the torch fallbacks run)"
    else:
        try:
            selection = select_variant(requested)
            kernels = f"{selection.variant} ({selection.reason})"
            if shutil.which("gcc") is None:
                kernels += "; but gcc is not on PATH: the torch fallbacks would run"
        except ValueError as exc:
            kernels = f"error: {exc}"
    try:
        device = resolve_device(settings.model.device)
    except ModelLoadError as exc:
        return {"cpu_kernels": kernels, "dtype": f"error: {exc}"}
    dense = resolve_dtype(settings.model.dtype, device)
    dtype = f"{settings.model.dtype} -> {str(dense).removeprefix('torch.')} on {device.type}"
    return {"cpu_kernels": kernels, "dtype": dtype, "kv_cache_dtype": kv_cache_here(settings, dense)}


def kv_cache_here(settings: IzhSettings, model_dtype: Any) -> str:
    """The KV cache format `engine.kv_cache_dtype` resolves to, and, for a model already on this machine,
    its bytes per token (2 x layers x KV heads x head_dim x bytes per element) and tokens per GiB."""
    from izh.errors import IzhError
    from izh.hub import resolve_model
    from izh.kernels.kv_cache_dtype import kv_cache_format
    from izh.model.loader import load_model_config

    requested = settings.engine.kv_cache_dtype
    fmt = kv_cache_format(requested, model_dtype)
    text = f"{requested} -> {fmt.name}"
    if not settings.model.name:
        return text
    try:
        path = resolve_model(settings.model.name, settings.model.cache_dir.expanduser(), download=False)
        mc = load_model_config(str(path))
    except (IzhError, OSError, ValueError) as exc:
        return f"{text} (tokens per GiB: the model is not readable here: {exc})"
    problem = fmt.check_head_dim(mc.head_dim)
    if problem is not None:
        return f"{text}: error: {problem}"
    per_token = fmt.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    return f"{text}: {per_token} bytes per token, {(1 << 30) // per_token} tokens per GiB"
