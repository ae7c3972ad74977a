"""The izh command line: help, version, `config show`, settings flags, and no torch at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer
from typer.testing import CliRunner

from izh import __version__
from izh.settings import load_settings, settings_flag_specs
from izh_cli._common import with_settings_flags
from izh_cli.main import app


def invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, args, env=env)


def test_help_lists_the_commands() -> None:
    result = invoke(["--help"])
    assert result.exit_code == 0
    assert "pull" in result.stdout and "config" in result.stdout


def test_no_arguments_shows_help() -> None:
    result = invoke([])
    assert "Usage" in result.output and "pull" in result.output


def test_version() -> None:
    result = invoke(["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"izh {__version__}\n"


def test_importing_the_cli_does_not_import_torch() -> None:
    code = (
        "import sys, izh_cli.main, izh.settings, izh.hub\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_config_show_help_lists_every_settings_flag() -> None:
    result = CliRunner().invoke(app, ["config", "show", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    missing = [spec.flag for spec in settings_flag_specs() if spec.flag not in result.stdout]
    assert missing == []
    assert "--no-enable-prefix-caching" in result.stdout


def test_config_show_defaults_is_toml() -> None:
    result = invoke(["config", "show"], env={"IZH_CACHE_DIR": "/tmp/izh-x"})
    assert result.exit_code == 0, result.output
    data = tomllib.loads(result.stdout)
    assert data["engine"]["max_num_seqs"] == 128
    assert data["model"]["cache_dir"] == "/tmp/izh-x"
    assert data["logging"] == {"level": "info", "json": False}
    assert "max_model_len" not in data["model"]  # unset: a comment


def test_config_show_precedence_file_env_flag(tmp_path: Path) -> None:
    config = tmp_path / "izh.toml"
    config.write_text(
        '[engine]\nmax_num_seqs = 10\nseed = 5\n[server]\nport = 9000\n[model]\ndtype = "float16"\n'
    )
    env = {"IZH_ENGINE__MAX_NUM_SEQS": "20", "IZH_SERVER__PORT": "9001"}
    args = [
        "config",
        "show",
        "my-model",
        "--config",
        str(config),
        "--max-num-seqs",
        "30",
        "--no-enable-prefix-caching",
    ]
    result = invoke(args, env=env)
    assert result.exit_code == 0, result.output
    data = tomllib.loads(result.stdout)
    assert data["model"]["name"] == "my-model"
    assert data["model"]["dtype"] == "float16"
    assert data["engine"]["seed"] == 5
    assert data["server"]["port"] == 9001
    assert data["engine"]["max_num_seqs"] == 30
    assert data["engine"]["enable_prefix_caching"] is False


def test_config_show_output_is_a_valid_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("IZH_")]:  # `config show` reads the environment
        monkeypatch.delenv(name)
    args = [
        "config",
        "show",
        "--kv-cache-memory-bytes",
        "1GiB",
        "--allowed-origin",
        "http://a",
        "--log-level",
        "debug",
    ]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    saved = tmp_path / "out.toml"
    saved.write_text(result.stdout)
    expected = load_settings(
        overrides={
            "engine.kv_cache_memory_bytes": "1GiB",
            "server.allowed_origins": ["http://a"],
            "logging.level": "debug",
        },
        env={},
    )
    assert load_settings(saved, env={}) == expected


def test_config_show_says_what_runs_on_this_machine() -> None:
    from izh.kernels.cpu import select_variant

    result = invoke(["config", "show", "--cpu-kernels", "auto"])
    assert result.exit_code == 0, result.output
    best = select_variant("auto")
    assert f"#   cpu_kernels: {best.variant} ({best.reason})" in result.stdout
    assert "#   dtype: auto -> " in result.stdout
    off = invoke(
        ["config", "show", "--json", "--cpu-kernels", "off", "--dtype", "float32", "--device", "cpu"]
    )
    here = json.loads(off.stdout)["resolved_here"]
    assert here["cpu_kernels"].startswith("off") and here["dtype"] == "float32 -> float32 on cpu"


def test_config_show_json() -> None:
    result = invoke(["config", "show", "--json", "--port", "1234", "--log-json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["server"]["port"] == 1234
    assert data["logging"]["json"] is True


def test_config_show_never_prints_api_keys() -> None:
    env = {"IZH_SERVER__API_KEYS": "sekrit-env-1,sekrit-env-2"}
    toml_result = invoke(["config", "show"], env=env)
    assert toml_result.exit_code == 0, toml_result.output
    assert "sekrit" not in toml_result.output
    assert "# api_keys: 2 set (hidden)" in toml_result.stdout
    flag_result = invoke(["config", "show", "--json", "--api-key", "sekrit-flag"], env=env)
    assert flag_result.exit_code == 0, flag_result.output
    assert "sekrit" not in flag_result.output
    assert json.loads(flag_result.stdout)["server"]["api_keys"] == ["**********"]  # the flag replaced env


def test_config_show_bad_flag_value_exits_2_with_one_line() -> None:
    result = invoke(["config", "show", "--max-num-seqs", "-1"])
    assert result.exit_code == 2
    assert result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert (
        first
        == "Error: engine.max_num_seqs: Input should be greater than 0 (got -1, from flag --max-num-seqs)"
    )


def test_config_show_bad_file_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[engine]\nmax_num_seqz = 1\n")
    result = invoke(["config", "show", "--config", str(config)])
    assert result.exit_code == 2
    assert "unknown key engine.max_num_seqz" in result.stderr


def test_config_show_bad_choice_is_a_usage_error() -> None:
    result = invoke(["config", "show", "--dtype", "fp8"])
    assert result.exit_code == 2
    assert "fp8" in result.output


# --- with_settings_flags on a toy command --------------------------------------------------------------


def toy_app(seen: list[dict[str, Any]]) -> typer.Typer:
    toy = typer.Typer()

    @toy.command()
    @with_settings_flags
    def run(
        name: Annotated[str, typer.Argument()] = "x",
        verbose: Annotated[bool, typer.Option("--verbose")] = False,
        *,
        settings_overrides: dict[str, Any],
    ) -> None:
        seen.append({"name": name, "verbose": verbose, "overrides": settings_overrides})

    return toy


def test_only_the_flags_given_are_passed() -> None:
    seen: list[dict[str, Any]] = []
    args = [
        "abc",
        "--verbose",
        "--max-num-seqs",
        "4",
        "--no-enforce-eager",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
    ]
    result = CliRunner().invoke(
        toy_app(seen), [*args, "--kv-cache-memory-bytes", "2GiB", "--request-timeout-s", "1.5"]
    )
    assert result.exit_code == 0, result.output
    assert seen == [
        {
            "name": "abc",
            "verbose": True,
            "overrides": {
                "engine.max_num_seqs": 4,
                "engine.enforce_eager": False,
                "engine.kv_cache_memory_bytes": "2GiB",
                "server.api_keys": ["k1", "k2"],
                "server.request_timeout_s": 1.5,
            },
        }
    ]


def test_no_flags_means_no_overrides() -> None:
    seen: list[dict[str, Any]] = []
    result = CliRunner().invoke(toy_app(seen), [])
    assert result.exit_code == 0, result.output
    assert seen == [{"name": "x", "verbose": False, "overrides": {}}]


def test_decorator_requires_the_overrides_parameter() -> None:
    def command(name: str = "x") -> None:
        return None

    with pytest.raises(TypeError, match="settings_overrides"):
        with_settings_flags(command)


def test_load_error_hints_fit_the_error() -> None:
    from izh.errors import (
        ModelDownloadError,
        ModelLoadError,
        ModelSettingsError,
        UnsupportedModel,
        model_load_error,
    )
    from izh_cli._common import hint_for

    support = hint_for(UnsupportedModel("unsupported model architecture 'phi2' (supported: ...)"))
    setting = hint_for(
        ModelSettingsError("max_model_len 40000 is longer than the model's context (32768 tokens)")
    )
    assert setting is not None and "setting" in setting and "download" not in setting
    download = hint_for(ModelDownloadError("could not download x from PyPI"))
    parse = hint_for(ModelLoadError("x.gguf is not a GGUF file"))
    assert support is not None and "does not serve" in support and "network" not in support
    assert download is not None and "network" in download
    assert parse is not None and "network" not in parse and "download it again" in parse
    # The engine core sends a load error as text and code; the frontend raises the same kind again.
    for error in (
        UnsupportedModel("a"),
        ModelSettingsError("s"),
        ModelDownloadError("b"),
        ModelLoadError("c"),
    ):
        again = model_load_error(error.message, error.code)
        assert type(again) is type(error) and again.code == error.code
