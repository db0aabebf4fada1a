"""`kvshare serve | generate | estimate | healthcheck | build-kernels | cache-report`.

Heavy imports (torch, the engine runtime) happen inside the subcommand that needs them,
so `kvshare --help`, `kvshare healthcheck` and the app modules stay light.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from app import offline
from app.settings import SettingsError, add_settings_flags, flag_overrides, load_settings

# `kvshare serve`'s exit status when it cannot start: the model (or its tokenizer) cannot load;
# uvicorn exits with the same (its STARTUP_FAILURE) when the port is taken or the response store
# cannot open. 2: a bad setting. `kvshare generate` exits with it too when the model cannot load.
STARTUP_FAILED_EXIT_STATUS = offline.MODEL_LOAD_FAILED_STATUS


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
        notes=f"Exit status: 0 once stopped; 2 for a bad setting; {STARTUP_FAILED_EXIT_STATUS} "
        "when it cannot start: the model cannot load (the last line on stderr says why), the "
        "port is taken, the response store cannot open.",
    )
    _add_command(
        commands,
        "generate",
        "generate text offline (no HTTP) with the engine settings",
        add_arguments=offline.add_generate_arguments,
        handler=_offline(offline.run_generate),
        notes="Exit status: 0 once generated; 2 for a bad setting or request; "
        f"{STARTUP_FAILED_EXIT_STATUS} when the model cannot load (the last line on stderr says "
        "why).",
    )
    _add_command(
        commands,
        "estimate",
        "KV memory per token, per context and batch, for a model's config",
        add_arguments=offline.add_estimate_arguments,
        handler=_offline(offline.run_estimate),
    )
    _add_command(
        commands,
        "healthcheck",
        "exit 0 if the server answers /health (or /ready), else 1: a container health check",
        add_arguments=_add_healthcheck_arguments,
        handler=_healthcheck,
    )
    kernels = commands.add_parser(
        "build-kernels",
        help="compile the native CPU kernels ahead, for hosts without a compiler",
        description="Compile the portable levels of the native CPU kernels into DIR; a host "
        "without a C++ compiler loads the best one it runs when KVSHARE_PREBUILT_KERNELS=DIR.",
    )
    kernels.add_argument("directory", metavar="DIR", type=Path)
    kernels.add_argument(  # engine.runtime.cpu.native.PREBUILT_LEVELS, kept light here
        "--levels", default="avx512,avx2,baseline", help="comma-separated, best first"
    )
    kernels.set_defaults(handler=_build_kernels)
    report = commands.add_parser(
        "cache-report",
        help="where a tenant's recent prompts diverge (GET /debug/cache_report), in words",
        description="Print the server's cache report for the tenant of the API key "
        "(docs/cache-diagnostics.md).",
    )
    report.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    report.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    report.add_argument("--cache-salt", help="the cache_salt of the prompts (none: unsalted)")
    report.add_argument("--json", action="store_true", help="print the report's JSON")
    report.set_defaults(handler=_cache_report)
    return parser


def _cache_report(args: argparse.Namespace) -> int:
    from urllib.error import HTTPError, URLError

    from app.diagnostics.cache_report import fetch_report, format_report

    try:
        report = fetch_report(args.url, args.api_key, args.cache_salt)
    except (HTTPError, URLError, OSError) as exc:
        print(f"kvshare cache-report: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    from engine.runtime.cpu.native import NativeBuildError, build_prebuilt

    levels = tuple(level.strip() for level in args.levels.split(",") if level.strip())
    try:
        for path in build_prebuilt(args.directory, levels):
            print(path)
    except (NativeBuildError, ValueError) as exc:
        print(f"kvshare build-kernels: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_command(
    commands, name: str, help_text: str, add_arguments, handler, notes: str = ""
) -> None:
    """A subcommand that reads the settings (--config, KVSHARE_*, flags) like every other."""
    settings = "Settings: built-in defaults < --config YAML < KVSHARE_* env < flags."
    command = commands.add_parser(name, help=help_text, description=f"{settings} {notes}".strip())
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
    server = build_server(create_app(engine, settings), settings)
    record = _record_address(settings.server.host, settings.server.port)
    try:
        asyncio.run(server.serve())  # returns by itself when the model fails to load
    finally:
        if record is not None:
            record.unlink(missing_ok=True)
    if server.load_error is not None:  # the last line on stderr says why, on one line
        reason = " ".join(server.load_error.split())
        print(f"kvshare serve: error: the model failed to load: {reason}", file=sys.stderr)
        return STARTUP_FAILED_EXIT_STATUS
    return 0


# -- healthcheck ------------------------------------------------------------------------------
# A Dockerfile HEALTHCHECK runs `kvshare healthcheck` beside the server and cannot see the
# serve command's flags (`docker run IMAGE kvshare serve --port 9000`). So `kvshare serve`
# records the address it listens on, one file per process, and a health check given no
# settings of its own probes the recorded servers; given --config or flags, it reads the
# settings as serve does (defaults < --config < KVSHARE_* < flags).


def serve_records_dir() -> Path:
    """Where this user's `kvshare serve` processes record their addresses."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"kvshare-{os.getuid()}"


def _record_address(host: str, port: int) -> Path | None:
    """Record this process's address; None when there is none to record or no place for it
    (a read-only filesystem costs the health check its discovery, never the server)."""
    if port == 0:  # an ephemeral port is known only once bound
        return None
    path = serve_records_dir() / f"serve-{os.getpid()}.json"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(json.dumps({"pid": os.getpid(), "host": host, "port": port}))
    except OSError as e:
        print(f"kvshare serve: warning: cannot record the address in {path}: {e}", file=sys.stderr)
        return None
    return path


def recorded_addresses() -> list[tuple[str, int]]:
    """(host, port) of every recorded server whose process is alive; stale records go."""
    addresses = []
    for path in sorted(serve_records_dir().glob("serve-*.json")):
        try:
            record = json.loads(path.read_text())
            pid, host, port = int(record["pid"]), str(record["host"]), int(record["port"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _is_alive(pid):
            addresses.append((host, port))
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return addresses


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _add_healthcheck_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ready", action="store_true", help="probe /ready (model loaded, not draining)"
    )
    parser.add_argument("--url", default=None, help="probe this URL instead")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds per probe")


def probe_url(host: str, port: int, path: str) -> str:
    """The URL that reaches a server listening on host:port (any-address: the loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def _healthcheck_urls(args: argparse.Namespace) -> list[str] | None:
    if args.url is not None:
        return [args.url]
    path = "/ready" if args.ready else "/health"
    if args.config is None and not flag_overrides(args):
        recorded = recorded_addresses()
        if recorded:
            return [probe_url(host, port, path) for host, port in recorded]
    settings = _load(args, "healthcheck")
    if settings is None:
        return None
    return [probe_url(settings.server.host, settings.server.port, path)]


def _probe(url: str, timeout_s: float) -> str | None:
    """None if `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"status {response.status}"
    except urllib.error.HTTPError as e:
        return f"status {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def _healthcheck(args: argparse.Namespace) -> int:
    """Exit 0 when every probed server answers, else 1 (Docker reads any other code as 1)."""
    urls = _healthcheck_urls(args)
    if urls is None:
        return 1
    failures = [f"{url}: {why}" for url in urls if (why := _probe(url, args.timeout)) is not None]
    for failure in failures:
        print(f"kvshare healthcheck: {failure}", file=sys.stderr)
    if not failures:
        print("healthy: " + " ".join(urls))
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
