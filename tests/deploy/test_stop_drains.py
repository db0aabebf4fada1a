"""A stop never cuts a stream: SIGTERM to a real server process (uvicorn over the FakeEngine)
whose stream outlives shutdown_grace_seconds ends that stream with an error event and
`data: [DONE]`, and the process exits 0. (A stream that finishes within the grace keeps its
finish_reason: tests/app/test_server.py::test_sigterm_drains_then_exits.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

APP_TESTS = Path(__file__).resolve().parents[1] / "app"
REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(APP_TESTS))

from serve_fake import assert_exited_cleanly, ready_child, sigterm_mid_stream  # noqa: E402
from tiny_tokenizer import build_tiny_tokenizer  # noqa: E402

TIMEOUT_S = 30.0
GRACE_S = 0.5
STEP_DELAY_S = 0.05  # 200 tokens: 10 s, far past the grace


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_past_the_grace_ends_the_stream_with_an_error_and_done(tmp_path: Path) -> None:
    tokenizer_dir = build_tiny_tokenizer(tmp_path / "tokenizer")
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 200,
        "ignore_eos": True,
    }
    with ready_child(tokenizer_dir, STEP_DELAY_S, GRACE_S, timeout_s=TIMEOUT_S) as (child, url):
        payloads = sigterm_mid_stream(child, url, body, TIMEOUT_S)
        assert payloads[-1] == "[DONE]"
        last = json.loads(payloads[-2])
        assert last["error"]["code"] == "draining"
        assert last["error"]["type"] == "server_error"
        # It ended early: some tokens came, far from all 200 (the grace, not the length, ended it).
        contents = [json.loads(p)["choices"][0]["delta"].get("content") for p in payloads[:-2]]
        assert 0 < len([c for c in contents if c]) < 200
        assert_exited_cleanly(child, TIMEOUT_S)
