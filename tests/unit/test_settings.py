"""IzhSettings: precedence, one-line errors naming field, value and source, the example file, flags."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from izh.config import EngineConfig, SpeculativeConfig
from izh.settings import (
    SECTIONS,
    IzhSettings,
    KeyRateLimit,
    SettingsError,
    env_cache_dir,
    env_cpu_kernels,
    iter_setting_fields,
    load_settings,
    parse_byte_size,
    settings_flag_specs,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config.toml"


def write_toml(tmp_path: Path, text: str, name: str = "prod.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- precedence -------------------------------------------------------------------------------------


def test_defaults_without_any_source() -> None:
    settings = load_settings(env={})
    assert settings.model.name == "smollm2"
    assert settings.engine.max_num_seqs == 128
    assert settings.server.port == 8000
    assert settings.server.api_keys == []
    assert settings.logging.level == "info"
    assert settings.logging.json_format is False


def test_file_then_env_then_flag(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path,
        """
        [model]
        dtype = "float16"
        [engine]
        max_num_seqs = 10
        block_size = 32
        [server]
        port = 9000
        host = "0.0.0.0"
        [logging]
        level = "warning"
        """,
    )
    env = {
        "IZH_ENGINE__MAX_NUM_SEQS": "20",
        "IZH_SERVER__PORT": "9001",
        "IZH_LOGGING__LEVEL": "DEBUG",
        "PATH": "/usr/bin",
    }
    overrides = {"engine.max_num_seqs": 30, "logging.json": True}
    settings = load_settings(config, overrides, env)
    assert settings.engine.max_num_seqs == 30  # flag beats env and file
    assert settings.server.port == 9001  # env beats file
    assert settings.logging.level == "debug"  # env beats file, case-insensitive
    assert settings.logging.json_format is True  # flag over the default
    assert settings.model.dtype == "float16"  # file over the default
    assert settings.engine.block_size == 32
    assert settings.server.host == "0.0.0.0"
    assert settings.engine.enable_prefix_caching is True  # untouched default


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IZH_ENGINE__MAX_NUM_SEQS", "7")
    assert load_settings().engine.max_num_seqs == 7


def test_env_empty_value_unsets_an_optional_field(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[model]\nmax_model_len = 4096\n")
    assert load_settings(config, env={}).model.max_model_len == 4096
    assert load_settings(config, env={"IZH_MODEL__MAX_MODEL_LEN": ""}).model.max_model_len is None
    assert load_settings(config, env={"IZH_MODEL__MAX_MODEL_LEN": "none"}).model.max_model_len is None


def test_env_bool_and_float_values() -> None:
    settings = load_settings(
        env={"IZH_ENGINE__ENABLE_PREFIX_CACHING": "false", "IZH_SERVER__REQUEST_TIMEOUT_S": "2.5"}
    )
    assert settings.engine.enable_prefix_caching is False
    assert settings.server.request_timeout_s == 2.5


def test_cache_dir_shortcut_and_nested_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_settings(env={"IZH_CACHE_DIR": "~/c1"}).model.cache_dir == tmp_path / "c1"
    both = {"IZH_CACHE_DIR": str(tmp_path / "c1"), "IZH_MODEL__CACHE_DIR": str(tmp_path / "c2")}
    assert load_settings(env=both).model.cache_dir == tmp_path / "c2"


def test_cpu_kernels_setting_round_trips(tmp_path: Path) -> None:
    assert load_settings(env={}).engine.cpu_kernels == "auto"
    assert load_settings(env={"IZH_ENGINE__CPU_KERNELS": "AVX2"}).engine.cpu_kernels == "avx2"
    # IZH_CPU_KERNELS is a shortcut (0 = off, the old switch); the nested variable wins.
    assert load_settings(env={"IZH_CPU_KERNELS": "0"}).engine.cpu_kernels == "off"
    assert load_settings(env={"IZH_CPU_KERNELS": "1"}).engine.cpu_kernels == "auto"
    both = {"IZH_CPU_KERNELS": "off", "IZH_ENGINE__CPU_KERNELS": "generic"}
    assert load_settings(env=both).engine.cpu_kernels == "generic"
    config = tmp_path / "izh.toml"
    config.write_text('[engine]\ncpu_kernels = "neon"\n')
    assert load_settings(config, env={}).engine.cpu_kernels == "neon"
    flagged = load_settings(config, overrides={"engine.cpu_kernels": "amx"}, env={})
    assert flagged.engine.cpu_kernels == "amx"
    assert flagged.to_engine_config("/m").cpu_kernels == "amx"
    specs = {spec.dotted: spec for spec in settings_flag_specs()}
    assert specs["engine.cpu_kernels"].flag == "--cpu-kernels"
    assert specs["engine.cpu_kernels"].choices == ("auto", "off", "generic", "avx2", "avx512", "amx", "neon")
    with pytest.raises(SettingsError, match=r"engine.cpu_kernels: .*sse9.*IZH_CPU_KERNELS"):
        load_settings(env={"IZH_CPU_KERNELS": "sse9"})


def test_env_cpu_kernels_alone() -> None:
    assert env_cpu_kernels({}) == "auto"
    assert env_cpu_kernels({"IZH_CPU_KERNELS": "0"}) == "off"
    assert env_cpu_kernels({"IZH_CPU_KERNELS": "0", "IZH_ENGINE__CPU_KERNELS": "Generic"}) == "generic"
    with pytest.raises(SettingsError, match="IZH_ENGINE__CPU_KERNELS"):
        env_cpu_kernels({"IZH_ENGINE__CPU_KERNELS": "fast"})


def test_foreign_env_vars_are_ignored() -> None:
    env = {"IZH_DEBUG": "1", "IZH_OTHER__THING": "x", "HOME": "/", "izh_engine__max_num_seqs": "3"}
    assert load_settings(env=env) == load_settings(env={})


# --- errors: one line naming field, value and source ----------------------------------------------


def test_bad_env_value_names_field_value_and_variable() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"IZH_ENGINE__MAX_NUM_SEQS": "-1"})
    assert str(info.value) == (
        "engine.max_num_seqs: Input should be greater than 0 "
        "(got -1, from environment variable IZH_ENGINE__MAX_NUM_SEQS)"
    )


def test_bad_file_value_names_the_file(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[server]\nport = 70000\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config, env={})
    message = str(info.value)
    assert message.startswith("server.port: Input should be less than or equal to 65535 (got 70000, ")
    assert message.endswith(f"from config file {config})")
    assert "\n" not in message


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(overrides={"engine.max_num_seqs": -1}, env={})
    assert str(info.value) == (
        "engine.max_num_seqs: Input should be greater than 0 (got -1, from flag --max-num-seqs)"
    )


def test_flag_error_wins_over_valid_env() -> None:
    with pytest.raises(SettingsError, match=r"model\.dtype: .*\(got 'fp8', from flag --dtype\)"):
        load_settings(overrides={"model.dtype": "fp8"}, env={"IZH_MODEL__DTYPE": "float16"})


def test_bad_positional_model_names_the_argument() -> None:
    with pytest.raises(SettingsError, match=r"model\.name: .*from argument MODEL"):
        load_settings(overrides={"model.name": ""}, env={})


def test_several_errors_still_give_one_line() -> None:
    env = {"IZH_ENGINE__MAX_NUM_SEQS": "0", "IZH_SERVER__PORT": "x"}
    with pytest.raises(SettingsError) as info:
        load_settings(env=env)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith("[+1 more]")


def test_unknown_toml_key_is_rejected(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[engine]\nmax_num_seqz = 3\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config, env={})
    assert str(info.value) == (
        f"config file {config}: unknown key engine.max_num_seqz (did you mean max_num_seqs?)"
    )


def test_unknown_toml_section_is_rejected(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[servre]\nport = 1\n")
    with pytest.raises(SettingsError, match=r"unknown section \[servre\] \(did you mean server\?\)"):
        load_settings(config, env={})


def test_toml_section_must_be_a_table(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "engine = 3\n")
    with pytest.raises(SettingsError, match="engine must be a table"):
        load_settings(config, env={})


def test_unknown_env_field_of_a_known_section_is_rejected() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"IZH_ENGINE__MAX_NUM_SEQZ": "3"})
    assert "IZH_ENGINE__MAX_NUM_SEQZ" in str(info.value)
    assert "did you mean max_num_seqs?" in str(info.value)


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(SettingsError, match=r"unknown setting engine\.nope"):
        load_settings(overrides={"engine.nope": 1}, env={})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"config file .*missing\.toml: not found"):
        load_settings(tmp_path / "missing.toml", env={})


def test_unparsable_config_file(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[engine\nmax_num_seqs = 3\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config, env={})
    assert str(info.value).startswith(f"config file {config}: invalid TOML:")
    assert isinstance(info.value, ValueError)


# --- value parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 GiB", 3 * 2**29),
        ("64kib", 64 * 1024),
        ("1024", 1024),
        ("7B", 7),
    ],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert parse_byte_size(text) == expected
    settings = load_settings(env={"IZH_ENGINE__KV_CACHE_MEMORY_BYTES": text})
    assert settings.engine.kv_cache_memory_bytes == expected


def test_byte_size_from_file_as_int_or_string(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path, '[engine]\nkv_cache_memory_bytes = "2GiB"\n[server]\nmax_body_bytes = 4096\n'
    )
    settings = load_settings(config, env={})
    assert settings.engine.kv_cache_memory_bytes == 2 * 2**30
    assert settings.server.max_body_bytes == 4096


@pytest.mark.parametrize("text", ["2XB", "GiB", "-1GiB", "1e9"])
def test_bad_byte_sizes(text: str) -> None:
    with pytest.raises(SettingsError, match=r"engine\.kv_cache_memory_bytes: .*size"):
        load_settings(env={"IZH_ENGINE__KV_CACHE_MEMORY_BYTES": text})


@pytest.mark.parametrize("raw", ['["k1", "k2"]', "k1, k2", "k1,k2,"])
def test_api_keys_from_env_json_or_commas(raw: str) -> None:
    settings = load_settings(env={"IZH_SERVER__API_KEYS": raw})
    assert settings.server.api_key_values() == frozenset({"k1", "k2"})


def test_api_keys_never_shown() -> None:
    settings = load_settings(env={"IZH_SERVER__API_KEYS": "topsecret"})
    assert "topsecret" not in repr(settings)
    assert "topsecret" not in str(settings.to_display_dict())
    assert settings.to_display_dict()["server"]["api_keys"] == ["**********"]


def test_bad_api_keys_value_is_masked_in_the_error() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env={"IZH_SERVER__API_KEYS": '["topsecret"'})
    assert "topsecret" not in str(info.value)
    assert "server.api_keys" in str(info.value)


def test_allowed_origins_list() -> None:
    settings = load_settings(env={"IZH_SERVER__ALLOWED_ORIGINS": "http://a.example,http://b.example"})
    assert settings.server.allowed_origins == ["http://a.example", "http://b.example"]


def test_settings_are_frozen() -> None:
    settings = load_settings(env={})
    with pytest.raises(ValueError, match="frozen"):
        settings.engine.max_num_seqs = 3  # type: ignore[misc]


# --- the example file --------------------------------------------------------------------------------


def _example_keys_by_section() -> dict[str, set[str]]:
    """Keys written in examples/config.toml, commented out or not, by section."""
    keys: dict[str, set[str]] = {}
    section = ""
    for line in EXAMPLE.read_text(encoding="utf-8").splitlines():
        if header := re.fullmatch(r"\[(\w+)\]", line.strip()):
            section = header[1]
            keys[section] = set()
        elif section and (assignment := re.match(r"^#?\s*(\w+)\s*=", line)):
            keys[section].add(assignment[1])
    return keys


def test_example_config_lists_every_field() -> None:
    written = _example_keys_by_section()
    assert set(written) == set(SECTIONS)
    missing = [
        dotted
        for dotted, _ in iter_setting_fields()
        if dotted.split(".")[1] not in written[dotted.split(".")[0]]
    ]
    assert missing == []


def test_example_config_loads_to_the_defaults() -> None:
    assert load_settings(EXAMPLE, env={}) == load_settings(env={})
    assert tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))["engine"]["max_num_seqs"] == 128


def test_every_field_has_a_description() -> None:
    assert [dotted for dotted, info in iter_setting_fields() if not info.description] == []


# --- to_engine_config ----------------------------------------------------------------------------------


def test_to_engine_config_maps_every_field() -> None:
    overrides = {
        "model.served_model_name": "served",
        "model.dtype": "bfloat16",
        "model.quantization": "int8",
        "model.device": "cpu",
        "model.max_model_len": 512,
        "engine.block_size": 32,
        "engine.kv_cache_memory_bytes": "1MiB",
        "engine.kv_cache_memory_fraction": 0.5,
        "engine.kv_cache_dtype": "q8_0",
        "engine.max_num_batched_tokens": 256,
        "engine.max_num_seqs": 8,
        "engine.enable_prefix_caching": False,
        "engine.scheduling_policy": "priority",
        "engine.seed": 42,
        "engine.num_threads": 2,
        "engine.enforce_eager": True,
        "engine.attention_backend": "torch_paged",
        "engine.cpu_kernels": "generic",
        "engine.prefill_attention_budget": 4096,
        "model.pooling": "mean",
        "model.normalize_embeddings": False,
        "model.cache_dir": "/cache",
        "engine.tensor_parallel_size": 4,
        "engine.dist_init_addr": "10.0.0.1:29500",
        "engine.nnodes": 2,
        "engine.node_rank": 1,
        "engine.dist_timeout_s": 30.0,
        "model.lora_modules": ["a=/adapters/a"],
        "engine.enable_lora": True,
        "engine.max_loras": 2,
        "engine.max_lora_rank": 8,
        "speculative.config": '{"method": "ngram", "num_speculative_tokens": 3}',
        "speculative.prompt_lookup_min": 1,
        "speculative.prompt_lookup_max": 4,
        "speculative.disable_by_batch_size": 8,
    }
    config = load_settings(overrides=overrides, env={}).to_engine_config("/models/x.gguf")
    assert config == EngineConfig(
        model="/models/x.gguf",
        served_model_name="served",
        dtype="bfloat16",
        quantization="int8",
        device="cpu",
        max_model_len=512,
        block_size=32,
        kv_cache_memory_bytes=2**20,
        kv_cache_memory_fraction=0.5,
        kv_cache_dtype="q8_0",
        max_num_batched_tokens=256,
        prefill_attention_budget=4096,
        max_num_seqs=8,
        enable_prefix_caching=False,
        scheduling_policy="priority",
        seed=42,
        num_threads=2,
        enforce_eager=True,
        attention_backend="torch_paged",
        cpu_kernels="generic",
        pooling="mean",
        normalize_embeddings=False,
        lora_modules=(("a", "/adapters/a"),),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        cache_dir="/cache",
        tensor_parallel_size=4,
        dist_init_addr="10.0.0.1:29500",
        nnodes=2,
        node_rank=1,
        dist_timeout_s=30.0,
        speculative=SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=1,
            prompt_lookup_max=4,
            disable_by_batch_size=8,
        ),
    )
    # No EngineConfig field may keep its default silently: each one differs from it above (but the
    # torchrun rank fields, which come from torchrun's environment: izh.config.with_torchrun_env).
    defaults = EngineConfig(model="/models/x.gguf")
    same = [
        f.name
        for f in dataclasses.fields(EngineConfig)
        if getattr(config, f.name) == getattr(defaults, f.name)
    ]
    assert same == ["model", "dist_rank", "dist_local_rank"]


def test_served_model_name_defaults_to_the_model_name() -> None:
    settings = load_settings(overrides={"model.name": "/m/SmolLM2.gguf"}, env={})
    assert settings.to_engine_config("/m/SmolLM2.gguf").served_model_name == "/m/SmolLM2.gguf"


# --- flag specs ----------------------------------------------------------------------------------------


def test_flag_specs_cover_every_field_but_the_model_name() -> None:
    specs = settings_flag_specs()
    assert [spec.dotted for spec in specs] == [d for d, _ in iter_setting_fields() if d != "model.name"]
    assert len({spec.flag for spec in specs}) == len(specs)
    assert len({spec.param_name for spec in specs}) == len(specs)
    assert all(re.fullmatch(r"--[a-z][a-z0-9-]*", spec.flag) for spec in specs)


def test_flag_naming_rule() -> None:
    by_dotted = {spec.dotted: spec for spec in settings_flag_specs()}
    assert by_dotted["engine.max_num_seqs"].flag == "--max-num-seqs"
    assert by_dotted["engine.max_num_seqs"].python_type is int
    assert by_dotted["server.port"].flag == "--port"
    assert by_dotted["model.dtype"].choices == ("auto", "float32", "bfloat16", "float16")
    api_key = by_dotted["server.api_keys"]
    assert (api_key.flag, api_key.multiple, api_key.secret, api_key.default) == (
        "--api-key",
        True,
        True,
        None,
    )
    assert by_dotted["logging.level"].flag == "--log-level"
    assert by_dotted["logging.json"].flag == "--log-json"
    assert by_dotted["engine.enforce_eager"].python_type is bool
    kv = by_dotted["engine.kv_cache_memory_bytes"]
    assert (kv.python_type, kv.byte_size) == (str, True)
    assert by_dotted["server.request_timeout_s"].python_type is float


def test_direct_construction_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IZH_ENGINE__MAX_NUM_SEQS", "5")
    assert IzhSettings().engine.max_num_seqs == 128


def test_env_cache_dir_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert env_cache_dir({}) == tmp_path / ".cache" / "izh"
    assert env_cache_dir({}) == load_settings(env={}).model.cache_dir
    assert env_cache_dir({"IZH_CACHE_DIR": "~/a"}) == tmp_path / "a"
    assert env_cache_dir({"IZH_CACHE_DIR": "/a", "IZH_MODEL__CACHE_DIR": "/b"}) == Path("/b")
    monkeypatch.setenv("IZH_CACHE_DIR", str(tmp_path / "from-env"))
    assert env_cache_dir() == tmp_path / "from-env"


# --- [limits] and [rate_limits] ---------------------------------------------------------------------


def test_limits_and_rate_limits_from_file_env_and_flags(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path,
        """
        [limits]
        max_messages = 10
        max_schema_bytes = "1KiB"
        [rate_limits]
        tokens_per_minute = 6000
        per_key = ["aaaa1111 burst_tokens=50", "bbbb2222 tokens_per_minute=60 max_concurrent_requests=2"]
        """,
    )
    env = {"IZH_LIMITS__MAX_N": "4", "IZH_RATE_LIMITS__MAX_CONCURRENT_REQUESTS": "8"}
    settings = load_settings(config, {"limits.trust_request_chat_template": True}, env)
    assert (settings.limits.max_messages, settings.limits.max_n) == (10, 4)
    assert settings.limits.max_schema_bytes == 1024
    assert settings.limits.trust_request_chat_template is True
    assert settings.rate_limits.default_limit() == KeyRateLimit(6000, None, 8)
    assert settings.rate_limits.key_limits() == {
        "aaaa1111": KeyRateLimit(6000, 50, 8),  # unset fields come from the section
        "bbbb2222": KeyRateLimit(60, None, 2),
    }


def test_per_key_rate_limits_from_env_and_the_repeatable_flag() -> None:
    env = {"IZH_RATE_LIMITS__PER_KEY": "aaaa1111 tokens_per_minute=5,bbbb2222 burst_tokens=7"}
    assert list(load_settings(env=env).rate_limits.key_limits()) == ["aaaa1111", "bbbb2222"]
    by_dotted = {spec.dotted: spec for spec in settings_flag_specs()}
    spec = by_dotted["rate_limits.per_key"]
    assert (spec.flag, spec.multiple) == ("--rate-limit", True)
    flags = {"rate_limits.per_key": ["cccc3333 tokens_per_minute=9"]}
    assert load_settings(overrides=flags, env={}).rate_limits.key_limits()["cccc3333"].tokens_per_minute == 9


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("aaaa1111", "sets no limit"),
        ("tokens_per_minute=5", "must start with a key id"),
        ("aaaa1111 tokens=5", "expected one of tokens_per_minute"),
        ("aaaa1111 burst_tokens=0", "positive integer"),
        ("aaaa1111 burst_tokens=-3", "positive integer"),
    ],
)
def test_bad_per_key_entries_are_one_line_errors(entry: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message) as info:
        load_settings(overrides={"rate_limits.per_key": [entry]}, env={})
    assert "rate_limits.per_key" in str(info.value) and "--rate-limit" in str(info.value)
    with pytest.raises(SettingsError, match="two entries"):
        load_settings(
            overrides={"rate_limits.per_key": ["k tokens_per_minute=1", "k burst_tokens=2"]}, env={}
        )


def test_reliability_settings_defaults() -> None:
    server = load_settings(env={}).server
    assert server.log_requests is True and server.log_prompts is False
    assert server.restart_dead_core is False and server.cache_salt_per_key is True
    assert (server.timeout_keep_alive_s, server.header_timeout_s, server.body_timeout_s) == (5, 10, 30)
    limits = load_settings(env={}).limits
    assert limits.trust_request_chat_template is False and limits.max_json_depth == 64
    with pytest.raises(SettingsError, match=r"limits\.max_top_logprobs"):
        load_settings(overrides={"limits.max_top_logprobs": 21}, env={})


def test_lora_settings_reach_the_engine_config(tmp_path: Path) -> None:
    config = write_toml(
        tmp_path,
        """
        [model]
        lora_modules = ["sql=adapters/sql", "chat = /abs/chat"]
        [engine]
        max_loras = 2
        max_lora_rank = 64
        """,
    )
    settings = load_settings(config_file=config, env={})
    engine = settings.to_engine_config("/m")
    assert engine.lora_modules == (("sql", str(Path("adapters/sql").resolve())), ("chat", "/abs/chat"))
    assert (engine.max_loras, engine.max_lora_rank, engine.enable_lora) == (2, 64, False)
    flags = load_settings(
        overrides={"model.lora_modules": ["a=/x"], "server.allow_runtime_lora_updating": True}, env={}
    )
    assert flags.to_engine_config("/m").enable_lora  # runtime loading needs the slots
    with pytest.raises(SettingsError, match=r"expected name=path for a LoRA adapter, got 'nopath'"):
        load_settings(overrides={"model.lora_modules": ["nopath"]}, env={})
    with pytest.raises(SettingsError, match="repeated: a"):
        load_settings(env={"IZH_MODEL__LORA_MODULES": "a=/x,a=/y"})


def test_speculative_config_json_and_section() -> None:
    """vLLM's --speculative-config JSON fills the [speculative] section (its keys win); bad JSON, an
    unknown key, an unknown method and min > max are one-line errors naming the setting."""
    settings = load_settings(
        overrides={
            "speculative.config": '{"method": "ngram", "prompt_lookup_max": 3}',
            "speculative.prompt_lookup_max": 7,
        },
        env={},
    )
    assert settings.speculative.to_config() == SpeculativeConfig(prompt_lookup_max=3)
    assert load_settings(env={}).to_engine_config("/m").speculative is None
    env = {"IZH_SPECULATIVE__METHOD": "ngram", "IZH_SPECULATIVE__NUM_SPECULATIVE_TOKENS": "2"}
    assert load_settings(env=env).speculative.to_config() == SpeculativeConfig(num_speculative_tokens=2)
    draft = load_settings(
        overrides={
            "speculative.config": '{"method": "draft_model", "model": "/d.gguf", "num_speculative_tokens": 4}'
        },
        env={},
    )
    assert draft.speculative.to_config() == SpeculativeConfig(
        method="draft_model", model="/d.gguf", num_speculative_tokens=4
    )
    for config, message in [
        ("{not json", "not valid JSON"),
        ('{"methd": "ngram"}', "unknown key(s) methd"),
        ('{"method": "eagle"}', "speculative.method"),
        ('{"method": "ngram", "prompt_lookup_min": 6}', "prompt_lookup_min 6 > prompt_lookup_max 5"),
        ("[1]", "must be a JSON object"),
        ('{"method": "draft_model"}', "method draft_model needs model"),
        ('{"method": "ngram", "model": "/d.gguf"}', "model and draft_p_min are the draft_model method's"),
    ]:
        with pytest.raises(SettingsError, match=re.escape(message)):
            load_settings(overrides={"speculative.config": config}, env={})


def test_override_generation_config_is_a_checked_json_object() -> None:
    settings = load_settings(overrides={"server.override_generation_config": '{"temperature": 0}'}, env={})
    assert settings.server.override_generation_config == '{"temperature": 0}'
    for bad, words in (
        ("[1]", "expected a JSON object"),
        ('{"temprature": 0}', "unknown key 'temprature'"),
        ('{"temperature": "hot"}', "temperature must be a number"),
        ("{", "not JSON"),
    ):
        with pytest.raises(SettingsError, match=r"server\.override_generation_config: .*" + re.escape(words)):
            load_settings(overrides={"server.override_generation_config": bad}, env={})


def test_kv_cache_dtype_flag_takes_the_formats_and_names_them_when_wrong() -> None:
    from izh.kernels.kv_cache_dtype import KV_CACHE_DTYPES

    spec = {s.dotted: s for s in settings_flag_specs()}["engine.kv_cache_dtype"]
    assert spec.flag == "--kv-cache-dtype" and spec.choices == KV_CACHE_DTYPES
    settings = load_settings(overrides={"engine.kv_cache_dtype": "Q8_0"}, env={})
    assert settings.to_engine_config("model.gguf").kv_cache_dtype == "q8_0"
    with pytest.raises(SettingsError) as info:
        load_settings(overrides={"engine.kv_cache_dtype": "int4"}, env={})
    message = str(info.value)
    assert message.startswith("engine.kv_cache_dtype: ") and message.endswith("from flag --kv-cache-dtype)")
    assert all(f"'{name}'" in message for name in KV_CACHE_DTYPES)
