"""The `izh` command: a thin Typer app; each command lives in its own module, imported only when that
command (or the root help, which lists them all) runs, and heavy things (torch, the engine, the server,
izh.settings) are imported inside command bodies, so that `izh inspect --once` and `izh bench` start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperGroup

from izh import __version__

if TYPE_CHECKING:
    from typer._click import Command, Context  # Typer's vendored click: the types its group uses

# Command name -> "module:attribute" (a command function, or a Typer app for a group), in help order.
COMMANDS = {
    "serve": "izh_cli.serve:serve",
    "pull": "izh_cli.pull:pull",
    "bench": "izh_cli.bench.cli:bench",
    "inspect": "izh_cli.inspect_cmd:inspect",
    "chat": "izh_cli.chat:chat",
    "config": "izh_cli.config_cmd:config_app",
}


def _build_command(name: str, target: str) -> Command:
    """The click command for ``target``, built as `app.command(name)` / `app.add_typer` would build it."""
    module_name, attribute = target.split(":")
    obj = getattr(importlib.import_module(module_name), attribute)
    if isinstance(obj, typer.Typer):
        group = typer.main.get_group(obj)
        group.name = name
        return group
    # A one-command app with the root's markup and no completion flags gives Typer's own single command.
    single = typer.Typer(rich_markup_mode="rich", pretty_exceptions_enable=False, add_completion=False)
    single.command(name)(obj)
    return typer.main.get_command(single)


class LazyCommands(TyperGroup):
    """The root group: each command's module is imported the first time the command is looked up."""

    def list_commands(self, ctx: Context) -> list[str]:
        return [*COMMANDS, *(name for name in super().list_commands(ctx) if name not in COMMANDS)]

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            self.commands[cmd_name] = _build_command(cmd_name, COMMANDS[cmd_name])
        return super().get_command(ctx, cmd_name)


app = typer.Typer(
    name="izh",
    help="izh: an OpenAI-compatible LLM inference server with its own engine.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    cls=LazyCommands,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"izh {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """izh: an OpenAI-compatible LLM inference server with its own engine."""


def main() -> None:
    """Console-script entry point (`izh`)."""
    app()


if __name__ == "__main__":
    main()
