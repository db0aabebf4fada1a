"""A real `kvshare serve` (real engine, real uvicorn on 127.0.0.1) for integration tests and
benchmarks: start one, and read its /metrics."""

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
from typing import IO

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(
    *flags: str, env: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> Iterator[str]:
    """Start `kvshare serve` with config/cpu.yaml plus `flags`; yield its base URL. Its log
    (stderr) goes to `stderr` if given, else to a pipe read when it fails to start.

    The exact mode (--quantization none) unless `flags` choose: the HF oracle's equalities hold
    only there, and config/cpu.yaml serves fp16 weights."""
    with running_process(*flags, env=env, stderr=stderr) as (_, base_url):
        yield base_url


@contextmanager
def running_process(
    *flags: str, env: dict[str, str] | None = None, stderr: IO[str] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """running_server(), yielding the process too (to kill it); stopped at the end if alive."""
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--config", "config/cpu.yaml"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if "--quantization" not in flags:
        command += ["--quantization", "none"]
    command += flags
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process)
        yield process, base_url
    finally:
        stop_process(process)


def stop_process(process: subprocess.Popen) -> None:
    """SIGINT (a graceful stop), then SIGKILL after 30 s (nothing if it has exited)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = process.stderr.read()[-4000:] if process.stderr else "(its log went to a file)"
            raise RuntimeError(f"server exited early:\n{log}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready in time")


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
