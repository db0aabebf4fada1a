"""`kvshare serve` with a model that cannot load: the process ends with status 3 and the reason
as the last line of stderr, never a server that is alive and never ready (`kvshare generate`
alike). Real `kvshare serve`
processes on 127.0.0.1, each bounded in time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import cli
from benchmarks.servers import free_port
from tests.tiny_models import TINY_CONFIG

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # imports (torch, transformers) take most of it; the exit itself is prompt


def _unknown_architecture(tmp_path: Path) -> str:
    model_dir = tmp_path / "tiny-unknown"
    model_dir.mkdir()
    config = {**TINY_CONFIG, "model_type": "llama", "architectures": ["NoSuchArchForCausalLM"]}
    (model_dir / "config.json").write_text(json.dumps(config))
    return str(model_dir)


def _not_a_gguf(tmp_path: Path) -> str:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(bytes(range(256)) * 16)
    return str(path)


def _missing_path(tmp_path: Path) -> str:
    return str(tmp_path / "no-such-model")


@pytest.mark.parametrize(
    ("make_model", "cause"),
    [
        (_unknown_architecture, "unsupported model architecture NoSuchArchForCausalLM"),
        (_not_a_gguf, "is not a GGUF file"),
        (_missing_path, "does not exist"),
    ],
    ids=["unknown-architecture", "not-a-gguf", "missing-path"],
)
def test_a_model_that_cannot_load_ends_the_process(tmp_path: Path, make_model, cause: str):
    model = make_model(tmp_path)
    command = [sys.executable, "-m", "app.cli", "serve", "--model", model, "--host", "127.0.0.1"]
    command += ["--port", str(free_port()), "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    last_line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == cli.STARTUP_FAILED_EXIT_STATUS == 3, done.stderr[-4000:]
    assert last_line.startswith("kvshare serve: error: the model failed to load: ")
    assert cause in last_line
    assert list((tmp_path / "run").glob("kvshare-*/serve-*.json")) == []  # its record is gone


def test_generate_ends_alike_when_the_model_cannot_load(tmp_path: Path):
    model = _unknown_architecture(tmp_path)
    command = [sys.executable, "-m", "app.cli", "generate", "--model", model, "--prompt", "hi"]
    command += ["--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == cli.STARTUP_FAILED_EXIT_STATUS, done.stderr[-4000:]
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("kvshare generate: error: the model failed to load: ")
    assert "unsupported model architecture NoSuchArchForCausalLM" in last_line
    assert done.stdout == ""


def test_the_reason_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys):
    """_serve's wiring, with the engine and uvicorn replaced: a server that stopped because
    the model failed gives status 3 and the reason on one line."""
    import app.server
    import engine.async_engine

    class Server:
        load_error = "ValueError: first line\n  second line"

        async def serve(self) -> None:
            pass

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(engine.async_engine, "AsyncEngine", lambda config: object())
    monkeypatch.setattr(app.server, "create_app", lambda engine, settings: object())
    monkeypatch.setattr(app.server, "build_server", lambda app, settings: Server())
    monkeypatch.setattr(app.server, "configure_logging", lambda level, log_format: None)
    assert cli.main(["serve", "--port", "18192"]) == 3
    assert capsys.readouterr().err == (
        "kvshare serve: error: the model failed to load: ValueError: first line second line\n"
    )
