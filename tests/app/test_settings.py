"""Settings: defaults < YAML < KVSHARE_* env < flags, validated once; config files documented."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from app.cli import build_parser, main
from app.settings import (
    ENGINE_KEYS,
    RUNTIME_ENV,
    SERVER_KEYS,
    ServerSettings,
    Settings,
    SettingsError,
    flag_overrides,
    load_settings,
)
from engine.core.config import EngineConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
CONFIG_FILES = ["default.yaml", "cpu.yaml", "cuda.yaml"]


def test_default_yaml_holds_exactly_the_built_in_defaults() -> None:
    assert load_settings(CONFIG_DIR / "default.yaml", environ={}) == Settings()


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_file_sets_every_key_with_a_comment_above(name: str) -> None:
    lines = (CONFIG_DIR / name).read_text().splitlines()
    keys = {}
    for number, line in enumerate(lines):
        match = re.match(r"^  (\w+):", line)
        if match:
            keys[match.group(1)] = number
            assert lines[number - 1].lstrip().startswith("#"), f"{name}: {line} has no comment"
    assert sorted(keys) == sorted(SERVER_KEYS + ENGINE_KEYS)
    load_settings(CONFIG_DIR / name, environ={})  # and it validates


def test_cpu_and_cuda_files_pick_their_device() -> None:
    cpu = load_settings(CONFIG_DIR / "cpu.yaml", environ={}).to_engine_config()
    cuda = load_settings(CONFIG_DIR / "cuda.yaml", environ={}).to_engine_config()
    assert (cpu.device, cpu.dtype, cpu.attention_backend) == ("cpu", "float32", "auto")
    assert (cuda.device, cuda.dtype, cuda.attention_backend) == ("cuda", "bfloat16", "triton")


def test_precedence_yaml_then_env_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "s.yaml"
    config.write_text("server:\n  port: 9000\n  host: 0.0.0.0\nengine:\n  block_size: 32\n")
    env = {"KVSHARE_PORT": "9001", "KVSHARE_MAX_NUM_SEQS": "8", "HOME": "/x"}
    settings = load_settings(config, env, {"port": "9002"})
    assert settings.server.port == 9002
    assert settings.server.host == "0.0.0.0"
    assert settings.engine.block_size == 32
    assert settings.engine.max_num_seqs == 8
    assert load_settings(config, env).server.port == 9001
    assert load_settings(config, {}).server.port == 9000


def test_env_values_are_parsed() -> None:
    env = {
        "KVSHARE_API_KEYS": "key-a, key-b",
        "KVSHARE_MAX_MODEL_LEN": "none",
        "KVSHARE_NUM_KV_BLOCKS": "128",
        "KVSHARE_ENABLE_PREFIX_CACHE": "false",
        "KVSHARE_LOG_PROMPTS": "true",
        "KVSHARE_GPU_MEMORY_UTILIZATION": "0.5",
        "KVSHARE_SERVED_MODEL_NAME": "",
    }
    settings = load_settings(None, env)
    assert settings.server.api_keys == ("key-a", "key-b")
    assert settings.server.log_prompts is True
    assert settings.server.served_model_name is None
    assert settings.to_engine_config() == EngineConfig(
        max_model_len=None, num_kv_blocks=128, enable_prefix_cache=False, gpu_memory_utilization=0.5
    )


def test_a_choice_named_none_is_that_choice_not_unset() -> None:
    """`quantization: none` is a mode (the exact one): from a flag or env it stays "none",
    where other keys read none as "not set"."""
    served = load_settings("config/cpu.yaml", {})
    assert served.engine.quantization == "native"
    from_env = load_settings("config/cpu.yaml", {"KVSHARE_QUANTIZATION": "none"})
    from_flag = load_settings("config/cpu.yaml", {}, flag_overrides(
        build_parser().parse_args(["serve", "--quantization", "none"])))  # fmt: skip
    assert from_env.engine.quantization == from_flag.engine.quantization == "none"


def test_unknown_env_name_is_skipped_with_a_warning(caplog) -> None:
    caplog.set_level(logging.WARNING)
    settings = load_settings(None, {"KVSHARE_PROT": "1"})
    assert settings == Settings()
    assert "KVSHARE_PROT" in caplog.text


def test_the_cpu_runtimes_own_variables_are_no_settings_and_not_warned_about(caplog) -> None:
    from engine.runtime.cpu import capabilities, native

    # The names the runtime reads are the ones the settings leave to it.
    names = {capabilities.ISA_ENV, capabilities.BF16_LINEAR_ENV, capabilities.AMX_ENV}
    assert names | {native.PREBUILT_ENV} == RUNTIME_ENV
    caplog.set_level(logging.WARNING)
    assert load_settings(None, dict.fromkeys(RUNTIME_ENV, "avx2")) == Settings()
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("yaml_text", "env", "needle"),
    [
        ("", {"KVSHARE_PORT": "abc"}, "server.port"),
        ("", {"KVSHARE_PORT": "70000"}, "server.port"),
        ("", {"KVSHARE_BLOCK_SIZE": "7"}, "block_size must be 8, 16, 32, 64 or 128"),
        ("", {"KVSHARE_LOG_FORMAT": "xml"}, "server.log_format"),
        ("server:\n  prot: 1\n", {}, "server.prot"),
        ("engine:\n  blok_size: 1\n", {}, "engine.blok_size"),
        ("servers: {}\n", {}, "unknown section"),
        ("- a\n- b\n", {}, "must be a mapping"),
        ("server: [\n", {}, "not valid YAML"),
    ],
)
def test_bad_settings_name_the_key(tmp_path: Path, yaml_text: str, env: dict, needle: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    with pytest.raises(SettingsError, match=re.escape(needle)):
        load_settings(config, env)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml", {})


def test_engine_keys_are_the_engine_config_fields() -> None:
    assert tuple(f.name for f in dataclasses.fields(EngineConfig)) == ENGINE_KEYS
    assert tuple(ServerSettings.model_fields) == SERVER_KEYS


def test_serve_flags_override_everything() -> None:
    args = build_parser().parse_args(
        ["serve", "--port", "9", "--api-keys", "a,b", "--model", "/m", "--max-model-len", "none"]
    )
    overrides = flag_overrides(args)
    assert overrides == {"port": "9", "api_keys": "a,b", "model": "/m", "max_model_len": "none"}
    settings = load_settings(None, {"KVSHARE_PORT": "1"}, overrides)
    assert settings.server.port == 9
    assert settings.server.api_keys == ("a", "b")
    assert settings.engine.model == "/m"
    assert settings.engine.max_model_len is None


def test_serve_reports_bad_settings_before_loading_anything(capsys) -> None:
    assert main(["serve", "--port", "not-a-port"]) == 2
    assert "server.port" in capsys.readouterr().err


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([])
    assert exit_info.value.code == 2


def test_no_prefix_cache_flag_turns_the_cache_off() -> None:
    for command in ("serve", "generate --prompt hi", "estimate"):
        args = build_parser().parse_args([*command.split(), "--no-prefix-cache"])
        settings = load_settings("config/cpu.yaml", {}, flag_overrides(args))
        assert settings.engine.enable_prefix_cache is False
        args = build_parser().parse_args(command.split())
        assert load_settings("config/cpu.yaml", {}, flag_overrides(args)).engine.enable_prefix_cache
