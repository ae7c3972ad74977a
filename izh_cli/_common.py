"""Helpers shared by the CLI commands: error reporting, exit codes, and settings flags.

Exit codes: 0 success; 1 a runtime failure (model not found, download failed, engine died), printed as
one red line plus a hint; 2 a usage or configuration error (bad flag, bad config file, bad IZH_*
variable), also one red line: configuration is input the user must fix before anything runs.

:func:`with_settings_flags` turns every setting into a flag generated from the IzhSettings model
(see izh.settings for the naming rule), so that commands never declare a setting twice::

    @app.command()
    @with_settings_flags
    def serve(
        model: Annotated[str | None, typer.Argument()] = None,
        config: ConfigOption = None,
        *,
        settings_overrides: dict[str, Any],
    ) -> None:
        settings = load_cli_settings(config, settings_overrides, model=model)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn, TypeVar

import typer

from izh.errors import (
    IzhError,
    ModelDownloadError,
    ModelLoadError,
    ModelNotFound,
    ModelSettingsError,
    UnsupportedModel,
)

if TYPE_CHECKING:
    from rich.console import Console

    from izh.hub import ProgressFn
    from izh.settings import FlagSpec, IzhSettings

# izh.settings (pydantic, pydantic-settings) and Rich are imported where they are used: `izh inspect`
# and `izh bench` import this module for fail() and must start without them.

EXIT_FAILURE = 1
EXIT_USAGE = 2

OVERRIDES_PARAM = "settings_overrides"
_SETTINGS_HINT = "see `izh config show --help` for every setting and its flag."

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="TOML settings file (see examples/config.toml); IZH_* variables and flags override it.",
        dir_okay=False,
        show_default=False,
    ),
]

_F = TypeVar("_F", bound=Callable[..., Any])

_PANELS = {
    "model": "Model settings",
    "engine": "Engine settings",
    "server": "Server settings",
    "logging": "Logging settings",
}


def stderr_console() -> Console:
    """A Rich console on stderr (made per use so that test runners' stream swaps are honoured)."""
    from rich.console import Console

    return Console(stderr=True)


def fail(message: str, hint: str | None = None, code: int = EXIT_FAILURE) -> NoReturn:
    """Print one red error line (and a dim hint line) on stderr, then exit with ``code``."""
    from rich.markup import escape

    console = stderr_console()
    console.print(f"[bold red]Error:[/] [red]{escape(message)}[/]", soft_wrap=True, highlight=False)
    if hint:
        console.print(f"[dim]Hint: {escape(hint)}[/]", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def hint_for(exc: IzhError) -> str | None:
    """The hint printed under an IzhError: what to do about it, fitting its kind (None: none)."""
    if isinstance(exc, ModelNotFound):
        return "`izh pull smollm2` fetches the default model; or pass a .gguf file or a Hugging Face folder."
    if isinstance(exc, UnsupportedModel):
        return "izh does not serve this model (the message says what it serves); pick a model of a supported family."
    if isinstance(exc, ModelSettingsError):
        return "change the setting the message names (`izh config show` prints the settings in effect)."
    if isinstance(exc, ModelDownloadError):
        return "check the network (proxy, HF_ENDPOINT) and the free disk space, then retry."
    if isinstance(exc, ModelLoadError):
        return "the file or folder is not a complete model izh can read: check it, or download it again."
    return None


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn the errors a user can act on into one red line and an exit code (2 for settings, else 1)."""
    from izh.settings import SettingsError

    try:
        yield
    except SettingsError as exc:
        fail(str(exc), _SETTINGS_HINT, EXIT_USAGE)
    except IzhError as exc:
        fail(exc.message, hint_for(exc))
    except OSError as exc:
        fail(str(exc), "check the path, its permissions and the free disk space.")


def load_cli_settings(
    config: Path | None, overrides: Mapping[str, Any], *, model: str | None = None
) -> IzhSettings:
    """load_settings for a command: flags in ``overrides``, the positional MODEL as model.name.

    A bad setting exits with status 2 after printing the one-line SettingsError.
    """
    from izh.settings import SettingsError, load_settings

    values = dict(overrides)
    if model is not None:
        values["model.name"] = model
    try:
        return load_settings(config, values)
    except SettingsError as exc:
        fail(str(exc), _SETTINGS_HINT, EXIT_USAGE)


# ---------------------------------------------------------------------------------------------------
# Settings flags


def _default_text(spec: FlagSpec) -> str | None:
    if spec.secret or spec.default is None or spec.default == []:
        return None
    if isinstance(spec.default, bool):
        return "enabled" if spec.default else "disabled"
    return str(spec.default)


def _help_text(spec: FlagSpec) -> str:
    from rich.markup import escape

    # The built-in default, written by hand: the option's own default is None, meaning "not given".
    text = spec.description
    if spec.multiple:
        text += " Repeat the flag for several values."
    default = _default_text(spec)
    if default is not None:
        text += f" [default: {default}]"
    return escape(text)  # help is rendered as Rich markup, where [...] would be a style tag


def _metavar(spec: FlagSpec) -> str | None:
    if spec.byte_size:
        return "<size>"
    if spec.multiple:
        return "<str>"
    return None


def _flag_annotation(spec: FlagSpec) -> Any:
    """The Typer annotation of one settings flag; every flag defaults to None meaning "not given"."""
    base: Any
    if spec.choices:
        base = Literal[spec.choices]  # a tuple subscript spells Literal["a", "b", ...]
    elif spec.multiple:
        base = list[spec.python_type]  # type: ignore[name-defined]
    else:
        base = spec.python_type
    decls = (
        (f"{spec.flag}/--no-{spec.flag.removeprefix('--')}",) if spec.python_type is bool else (spec.flag,)
    )
    option = typer.Option(
        *decls,
        help=_help_text(spec),
        show_default=False,
        rich_help_panel=_PANELS.get(spec.section, "Settings"),
        metavar=_metavar(spec),
    )
    return Annotated[base | None, option]


def collect_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings flags the user gave, by dotted key, from the wrapper's keyword arguments."""
    from izh.settings import settings_flag_specs

    overrides: dict[str, Any] = {}
    for spec in settings_flag_specs():
        value = values.get(spec.param_name)
        if value is None or (spec.multiple and not value):
            continue
        overrides[spec.dotted] = list(value) if spec.multiple else value
    return overrides


def with_settings_flags(func: _F) -> _F:
    """Add one flag per setting to a Typer command; the command gets ``settings_overrides`` instead.

    ``func`` must take a keyword-only ``settings_overrides: dict[str, Any]`` parameter; it receives the
    flags the user actually gave, keyed by dotted setting name, ready for load_settings. Apply it
    below ``@app.command()``.
    """
    from izh.settings import settings_flag_specs

    signature = inspect.signature(func, eval_str=True)
    if OVERRIDES_PARAM not in signature.parameters:
        raise TypeError(f"{func.__qualname__} needs a keyword-only {OVERRIDES_PARAM} parameter")
    specs = settings_flag_specs()
    own = [param for name, param in signature.parameters.items() if name != OVERRIDES_PARAM]
    clashes = {spec.param_name for spec in specs} & {param.name for param in own}
    if clashes:
        raise TypeError(f"{func.__qualname__} has parameters named like settings flags: {sorted(clashes)}")
    added = [
        inspect.Parameter(
            spec.param_name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_flag_annotation(spec)
        )
        for spec in specs
    ]
    setting_names = frozenset(spec.param_name for spec in specs)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in list(kwargs) if name in setting_names}
        return func(*args, **kwargs, **{OVERRIDES_PARAM: collect_overrides(flags)})

    params = [*own, *added]
    # Typer reads the signature (inspect stops unwrapping at __signature__) and the annotations: both
    # must show the generated flags, already evaluated.
    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {param.name: param.annotation for param in params}
    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------
# Progress


_PHASE_LABELS = {
    "download": "Downloading",
    "copy": "Copying from the installed package",
    "extract": "Extracting",
    "verify": "Verifying checksum",
}


@contextlib.contextmanager
def transfer_progress() -> Iterator[ProgressFn]:
    """A Rich progress display on stderr, one bar per phase; yields the izh.hub progress callback."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    bars = Progress(*columns, console=stderr_console())
    tasks: dict[str, TaskID] = {}

    def update(done_bytes: int, total_bytes: int, phase: str) -> None:
        total = total_bytes or None
        if not tasks:
            bars.start()  # only once there is work: an instant no-op pull prints nothing
        if phase not in tasks:
            tasks[phase] = bars.add_task(_PHASE_LABELS.get(phase, phase), total=total)
        bars.update(tasks[phase], completed=done_bytes, total=total)

    try:
        yield update
    finally:
        if tasks:
            bars.stop()
