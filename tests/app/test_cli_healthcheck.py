"""`kvshare healthcheck`: the address it probes follows the settings serve reads (flags, env,
config) and, given none, the address a running `kvshare serve` recorded; the exit code is
Docker's (0 healthy, 1 not). Probed against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import cli

REPO_ROOT = Path(__file__).resolve().parents[2]


STATUSES = {"/health": 200, "/ready": 503}  # alive, still loading


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(STATUSES.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass


@contextlib.contextmanager
def _server() -> Iterator[int]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records in a private dir; no KVSHARE_* of the test run's own."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    for name in [n for n in os.environ if n.startswith("KVSHARE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:9000/health"),
        ("", "http://127.0.0.1:9000/health"),
        ("::", "http://[::1]:9000/health"),
        ("10.1.2.3", "http://10.1.2.3:9000/health"),
        ("fd00::5", "http://[fd00::5]:9000/health"),
    ],
)
def test_probe_url_reaches_any_address_on_the_loopback(host: str, url: str) -> None:
    assert cli.probe_url(host, 9000, "/health") == url


def test_port_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with _server() as port:
        assert cli.main(["healthcheck", "--port", str(port)]) == 0
    assert capsys.readouterr().out.strip() == f"healthy: http://127.0.0.1:{port}/health"


def test_port_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with _server() as port:
        monkeypatch.setenv("KVSHARE_PORT", str(port))
        assert cli.main(["healthcheck"]) == 0
        monkeypatch.setenv("KVSHARE_PORT", str(_closed_port()))
        assert cli.main(["healthcheck"]) == 1


def test_port_from_the_config_file(tmp_path: Path) -> None:
    with _server() as port:
        config = tmp_path / "config.yaml"
        config.write_text(f"server:\n  host: 0.0.0.0\n  port: {port}\n")
        assert cli.main(["healthcheck", "--config", str(config)]) == 0


def test_ready_probes_ready(capsys: pytest.CaptureFixture[str]) -> None:
    with _server() as port:
        assert cli.main(["healthcheck", "--port", str(port), "--ready"]) == 1
    assert f"http://127.0.0.1:{port}/ready: status 503" in capsys.readouterr().err


def test_nothing_listening_is_unhealthy(capsys: pytest.CaptureFixture[str]) -> None:
    port = _closed_port()
    assert cli.main(["healthcheck", "--port", str(port)]) == 1
    assert f"http://127.0.0.1:{port}/health" in capsys.readouterr().err


def test_invalid_settings_are_unhealthy_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["healthcheck", "--port", "70000"]) == 1
    assert "port" in capsys.readouterr().err


def test_a_recorded_server_wins_over_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The container case: serve got --port, the health check gets nothing."""
    monkeypatch.setenv("KVSHARE_PORT", str(_closed_port()))  # what the settings alone say
    with _server() as port:
        record = cli._record_address("0.0.0.0", port)
        assert record is not None and record.parent == cli.serve_records_dir()
        assert cli.recorded_addresses() == [("0.0.0.0", port)]
        assert cli.main(["healthcheck"]) == 0
        # Given settings of its own, the health check reads them instead.
        assert cli.main(["healthcheck", "--port", str(_closed_port())]) == 1
        record.unlink()
    assert cli.main(["healthcheck"]) == 1  # back to the settings: nothing there


def test_a_dead_servers_record_is_ignored_and_removed() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    records = cli.serve_records_dir()
    records.mkdir(parents=True)
    stale = records / f"serve-{child.pid}.json"
    stale.write_text(f'{{"pid": {child.pid}, "host": "127.0.0.1", "port": 1}}')
    (records / "serve-garbage.json").write_text("not json")
    assert cli.recorded_addresses() == []
    assert not stale.exists()


def test_serve_records_its_address_while_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """_serve's wiring, with the engine and uvicorn replaced: recorded during, gone after."""
    import app.server
    import engine.async_engine

    seen = []

    class Server:
        load_error = None

        async def serve(self) -> None:
            seen.append(cli.recorded_addresses())

    monkeypatch.setattr(engine.async_engine, "AsyncEngine", lambda config: object())
    monkeypatch.setattr(app.server, "create_app", lambda engine, settings: object())
    monkeypatch.setattr(app.server, "build_server", lambda app, settings: Server())
    monkeypatch.setattr(app.server, "configure_logging", lambda level, log_format: None)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "18191"]) == 0
    assert seen == [[("0.0.0.0", 18191)]]
    assert cli.recorded_addresses() == []


def test_exit_code_of_the_command(tmp_path: Path) -> None:
    """What Docker runs: a process whose exit status is the verdict."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "app.cli", "healthcheck", "--timeout", "2", "--port"]
    with _server() as port:
        healthy = subprocess.run([*command, str(port)], env=env, capture_output=True, timeout=60)
    unhealthy = subprocess.run(
        [*command, str(_closed_port())], env=env, capture_output=True, timeout=60
    )
    assert (healthy.returncode, unhealthy.returncode) == (0, 1)
