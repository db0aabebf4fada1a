"""Typed settings: code defaults < YAML file < KVSHARE_* environment < CLI flags.

The YAML file has two sections, `server:` (ServerSettings) and `engine:` (the fields of
engine.config.EngineConfig, one to one). Environment variables and CLI flags name keys
flatly: KVSHARE_PORT / --port, KVSHARE_BLOCK_SIZE / --block-size. Everything is validated
once, in load_settings(); a bad value raises SettingsError naming the key and its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.core.config import CHOICES, EngineConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVSHARE_"
_NONE_WORDS = ("", "none", "null")


class SettingsError(ValueError):
    """A setting is missing, unknown or invalid; the message says which and where from."""


class ServerSettings(BaseModel):
    """The HTTP side. Every key is documented in config/default.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: tuple[str, ...] = ()
    operator_keys: tuple[str, ...] = ()  # /metrics and /debug/{faults,kv_blocks} (security.md)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_waiting_requests: int = Field(default=256, ge=1)
    # Fair share (docs/fair-scheduling.md): without api_keys, the `user` field as the tenant.
    tenant_from_user: bool = False
    # Per-tenant limits (app/serving/tenant_load.py), each a 429 with Retry-After; None: off.
    max_running_requests_per_tenant: int | None = Field(default=None, ge=1)
    max_waiting_requests_per_tenant: int | None = Field(default=None, ge=1)
    max_waiting_prompt_tokens_per_tenant: int | None = Field(default=None, ge=1)
    max_tenant_labels: int = Field(default=16, ge=1)  # distinct tenants in metrics; rest: other
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja file used instead of the model's own template
    default_max_tokens: int | None = Field(default=2048, ge=1)
    shutdown_grace_seconds: float = Field(default=30.0, ge=0.0)
    keepalive_seconds: float = Field(default=15.0, gt=0.0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    log_prompts: bool = False
    cache_diagnostics: bool = False  # every response carries cache_diagnostics
    cache_history_size: int = Field(default=256, ge=0)  # prompts kept per tenant; 0: off
    strip_volatile_system_lines: bool = False  # /v1/messages: drop an agent's billing line
    cors_allow_origins: tuple[str, ...] = ()
    # Caps on what one request may ask for (app/serving/limits.py); over one: a 400 naming the
    # field.
    max_n: int = Field(default=128, ge=1)
    max_output_tokens: int = Field(default=32768, ge=1)
    max_prompts: int = Field(default=64, ge=1)
    max_messages: int = Field(default=2048, ge=1)
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_string_chars: int = Field(default=512, ge=1)
    max_logit_bias_entries: int = Field(default=300, ge=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    max_logprob_entries: int = Field(default=1 << 20, ge=1)
    max_top_logprobs: int = Field(default=20, ge=0, le=20)
    max_tools: int = Field(default=128, ge=1)
    # Stored responses (app/responses/store.py): the SQLite file and its bounds.
    store_path: str | None = None  # None: <cache dir>/responses.sqlite3
    store_max_responses: int = Field(default=10000, ge=1)
    store_max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    store_ttl_seconds: float = Field(default=30 * 24 * 3600.0, gt=0.0)

    @field_validator("chat_template")
    @classmethod
    def _readable_template(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no chat template file {path!r}")
        return path


class Settings(BaseModel):
    """Everything `kvshare serve` needs: the server and the engine configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: ServerSettings = ServerSettings()
    engine: EngineConfig = EngineConfig()

    def to_engine_config(self) -> EngineConfig:
        """The engine's own frozen config (its fields are the `engine:` keys, one to one)."""
        return self.engine

    def store_path(self) -> Path:
        """The response store's SQLite file: store_path, else in the cache dir."""
        if self.server.store_path is not None:
            return Path(self.server.store_path).expanduser()
        return self.engine.cache_root() / "responses.sqlite3"


SERVER_KEYS = tuple(ServerSettings.model_fields)
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig))
_LIST_KEYS = frozenset({"api_keys", "operator_keys", "cors_allow_origins"})
# Switches: `--enable-fault-injection` alone means true (a value is still accepted).
_BOOL_KEYS = frozenset(
    [key for key, info in ServerSettings.model_fields.items() if info.annotation is bool]
    + [f.name for f in dataclasses.fields(EngineConfig) if f.type in (bool, "bool")]
)
assert not set(SERVER_KEYS) & set(ENGINE_KEYS), "flat env/CLI key names must be unique"


def _section_of(key: str) -> str:
    return "server" if key in SERVER_KEYS else "engine"


def _parse_flat(value: str, key: str) -> Any:
    """Env/CLI values arrive as strings; pydantic coerces numbers and booleans from them."""
    if key in _LIST_KEYS:
        return tuple(item.strip() for item in value.split(",") if item.strip())
    if key in CHOICES and value.strip() in CHOICES[key]:
        return value.strip()  # a named choice, even one spelled "none" (quantization: none)
    if value.strip().lower() in _NONE_WORDS:
        return None
    return value


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The raw sections of a settings YAML file (validated later, with the other sources)."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e}") from e
    except yaml.YAMLError as e:
        raise SettingsError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must be a mapping with server: and engine:")
    unknown = set(data) - {"server", "engine"}
    if unknown:
        raise SettingsError(f"config file {path}: unknown section(s) {sorted(unknown)}")
    return {section: dict(data.get(section) or {}) for section in ("server", "engine")}


# KVSHARE_ variables that are no settings but read by the CPU runtime itself
# (engine/runtime/cpu/capabilities.py, native.py): no warning for them.
RUNTIME_ENV = frozenset(
    {"KVSHARE_CPU_ISA", "KVSHARE_CPU_BF16_LINEAR", "KVSHARE_CPU_AMX", "KVSHARE_PREBUILT_KERNELS"}
)


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Flat key -> value from KVSHARE_<KEY> variables.

    A KVSHARE_ name that is no settings key is logged and skipped, not fatal: other tools
    (tests, benchmarks) may use the prefix too.
    """
    overrides: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in RUNTIME_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in SERVER_KEYS and key not in ENGINE_KEYS:
            logger.warning("ignoring %s: no settings key %r", name, key)
            continue
        overrides[key] = _parse_flat(value, key)
    return overrides


def load_settings(
    config_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    cli_overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge the sources (later wins) and validate once.

    `cli_overrides` maps flat keys to values (strings from flags are parsed like env values).
    """
    layers: dict[str, dict[str, Any]] = {"server": {}, "engine": {}}
    if config_path is not None:
        for section, values in read_yaml(config_path).items():
            layers[section].update(values)
    env = env_overrides(os.environ if environ is None else environ)
    for source in (env, dict(cli_overrides or {})):
        for key, value in source.items():
            parsed = _parse_flat(value, key) if isinstance(value, str) else value
            layers[_section_of(key)][key] = parsed
    try:
        return Settings.model_validate(layers)
    except ValidationError as e:
        raise SettingsError(_describe(e)) from e


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        lines.append(f"{where}: {item['msg']}")
    return "invalid settings: " + "; ".join(lines)


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per settings key (e.g. --block-size); values default to 'not given'.
    A boolean key's flag given without a value means true (--enable-fault-injection)."""
    for section, keys in (("server", SERVER_KEYS), ("engine", ENGINE_KEYS)):
        group = parser.add_argument_group(
            f"{section} settings (override --config and KVSHARE_*; see config/default.yaml)"
        )
        for key in keys:
            flag = "--" + key.replace("_", "-")
            if key in _BOOL_KEYS:
                group.add_argument(
                    flag, dest=key, default=None, metavar="BOOL", nargs="?", const="true"
                )
                continue
            group.add_argument(flag, dest=key, default=None, metavar=_metavar(key))
    parser.add_argument(
        "--no-prefix-cache",
        dest="enable_prefix_cache",
        action="store_const",
        const="false",
        help="turn the prefix cache off (same as --enable-prefix-cache false), for comparison",
    )


def _metavar(key: str) -> str:
    """What --help shows a flag takes: the engine's own list of choices where it has one."""
    if key in CHOICES:
        return "{" + ",".join(str(choice) for choice in CHOICES[key]) + "}"
    return "A,B" if key in _LIST_KEYS else "VALUE"


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags the user actually gave, as flat key -> raw string."""
    given = {key: getattr(args, key, None) for key in SERVER_KEYS + ENGINE_KEYS}
    return {key: value for key, value in given.items() if value is not None}
