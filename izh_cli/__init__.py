"""The `izh` command line (Typer); see izh_cli.main."""
