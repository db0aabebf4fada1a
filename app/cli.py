"""`kvshare serve | generate | estimate`.

Heavy imports (torch, the engine runtime) happen inside the subcommand that needs them,
so `kvshare --help` and the app modules stay light.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from app import offline
from app.settings import SettingsError, add_settings_flags, flag_overrides, load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="OpenAI-compatible LLM server: KV cache shared physically, isolated logically.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_command(
        commands,
        "serve",
        "serve the OpenAI-compatible HTTP API",
        add_arguments=None,
        handler=_serve,
    )
    _add_command(
        commands,
        "generate",
        "generate text offline (no HTTP) with the engine settings",
        add_arguments=offline.add_generate_arguments,
        handler=_offline(offline.run_generate),
    )
    _add_command(
        commands,
        "estimate",
        "KV memory per token, per context and batch, for a model's config",
        add_arguments=offline.add_estimate_arguments,
        handler=_offline(offline.run_estimate),
    )
    return parser


def _add_command(commands, name: str, help_text: str, add_arguments, handler) -> None:
    """A subcommand that reads the settings (--config, KVSHARE_*, flags) like every other."""
    command = commands.add_parser(
        name,
        help=help_text,
        description="Settings: built-in defaults < --config YAML < KVSHARE_* env < flags.",
    )
    command.add_argument("--config", metavar="YAML", help="settings file, e.g. config/cpu.yaml")
    if add_arguments is not None:
        add_arguments(command)
    add_settings_flags(command)
    command.set_defaults(handler=handler)


def _load(args: argparse.Namespace, command: str):
    try:
        return load_settings(args.config, os.environ, flag_overrides(args))
    except SettingsError as e:
        print(f"kvshare {command}: error: {e}", file=sys.stderr)
        return None


def _offline(run):
    def handler(args: argparse.Namespace) -> int:
        settings = _load(args, args.command)
        if settings is None:
            return 2
        return run(args, settings.to_engine_config())

    return handler


def _serve(args: argparse.Namespace) -> int:
    settings = _load(args, "serve")
    if settings is None:
        return 2
    from app.server import build_server, configure_logging, create_app
    from engine.async_engine import AsyncEngine  # lazy: loads torch

    configure_logging(settings.server.log_level, settings.server.log_format)
    engine = AsyncEngine(settings.to_engine_config())
    app = create_app(engine, settings)
    asyncio.run(build_server(app, settings).serve())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
