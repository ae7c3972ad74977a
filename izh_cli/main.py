"""The `izh` command: a thin Typer app; each command lives in its own module and imports heavy things
(torch, the engine, the server) inside its body, so that `izh --help` stays instant."""

from __future__ import annotations

from typing import Annotated

import typer

from izh import __version__
from izh_cli import chat, config_cmd, inspect_cmd, pull, serve
from izh_cli.bench import cli as bench_cli

app = typer.Typer(
    name="izh",
    help="izh: an OpenAI-compatible LLM inference server with its own engine.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
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


# Commands, one module each.
app.command("serve")(serve.serve)
app.command("pull")(pull.pull)
app.command("bench")(bench_cli.bench)
app.command("inspect")(inspect_cmd.inspect)
app.command("chat")(chat.chat)
app.add_typer(config_cmd.config_app, name="config")


def main() -> None:
    """Console-script entry point (`izh`)."""
    app()


if __name__ == "__main__":
    main()
