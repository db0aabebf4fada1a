"""Server processes for the benchmark drivers: start one and wait until it is ready, stop it,
a `kvshare serve` of this tree on a free port, its /metrics scraped, CPU seconds from /proc.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def proc_cpu_seconds(stat: Path, children: bool = False) -> float:
    """User + system CPU seconds in a /proc stat file: /proc/PID/stat for a process, or
    /proc/PID/task/TID/stat for one of its threads; children: with its waited-for children's."""
    # After the command name (which may hold spaces) the fields start with the state: utime,
    # stime, cutime and cstime are fields 14-17 of the whole line.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(value) for value in fields[11 : 15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    command: list[str],
    ready_url: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    log: Path | None = None,
) -> subprocess.Popen:
    """Start a server process and wait until GET ready_url answers 200 (raise if it exits or
    the time runs out, after stopping it). Its output goes to `log` (default: discarded)."""
    sink = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        command, cwd=cwd, env={**os.environ, **(env or {})}, stdout=sink, stderr=sink
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(ready_url, timeout=2.0, trust_env=False).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    except BaseException:  # Ctrl-C while waiting: the server must not outlive the driver
        stop_server(process)
        raise
    stop_server(process)
    raise RuntimeError(f"{command[0]} did not become ready at {ready_url} (log: {log})")


def stop_server(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT (a graceful stop), then SIGKILL after timeout_s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def running_kvshare(*flags: str) -> Iterator[str]:
    """A `kvshare serve` of this tree (config/cpu.yaml, the exact mode unless `flags` choose)
    on a free loopback port; yields its base URL, stops it at the end."""
    port = free_port()
    repo = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if "--quantization" not in flags:
        command += ["--quantization", "none"]
    process = start_server([*command, *flags], f"http://127.0.0.1:{port}/ready", cwd=repo)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(process)


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)$")


def scrape(base_url: str, operator_key: str | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (labels exactly as the server prints them);
    operator_key: the server's operator key, where it has operator_keys."""
    headers = {} if operator_key is None else {"Authorization": f"Bearer {operator_key}"}
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
    response.raise_for_status()
    samples = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match["name"] + (match["labels"] or "")] = float(match["value"])
    return samples
