"""With log_prompts off, no log line holds prompt text, on any path; no line holds an API key.

A real `kvshare serve` (SmolLM2, API keys on, log level debug so that every logger speaks)
gets a unique marker in its prompts through: a served request, a validation failure, a prompt
the engine's check refuses (longer than the context), a schema the grammar refuses, malformed
JSON, a body over max_body_bytes, a wrong API key, and client disconnects (mid-stream, and
before a non-streamed answer). Its whole log is then searched. The control: the same traffic
with log_prompts on puts the marker in the log, so the search does find what is there.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.integration.server import running_server

pytestmark = pytest.mark.integration

API_KEY = f"sk-privacy-{uuid.uuid4().hex}"
WRONG_KEY = f"sk-wrong-{uuid.uuid4().hex}"


@contextmanager
def logging_server(log_path: Path, *flags: str) -> Iterator[str]:
    """`kvshare serve` with its stderr (the log) in `log_path`; the key comes by environment,
    as config/default.yaml advises for secrets."""
    flags = ("--log-level", "debug", "--max-model-len", "1024", "--default-max-tokens", "4",
             "--max-body-bytes", "16384", *flags)  # fmt: skip
    with (
        log_path.open("w") as log,
        running_server(*flags, env={"KVSHARE_API_KEYS": API_KEY}, stderr=log) as base_url,
    ):
        yield base_url


def send_traffic(base_url: str, marker: str) -> list[int]:
    """The marker through every path; returns the statuses answered (disconnects: none)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    http = httpx.Client(base_url=f"{base_url}/v1", headers=headers, timeout=120)
    model = http.get("/models").json()["data"][0]["id"]
    user = [{"role": "user", "content": f"Say {marker} back."}]
    chat = {"model": model, "messages": user, "max_tokens": 2}
    schema = {"type": "object", "description": marker, "not": {}}
    requests = [
        ("/chat/completions", chat),  # served
        ("/completions", {"model": model, "prompt": marker, "max_tokens": 2, "logprobs": 1}),
        ("/chat/completions", {**chat, "temperature": 5}),  # validation failure
        ("/chat/completions", {**chat, "messages": [{"role": "user", "content": {"x": marker}}]}),
        ("/completions", {"model": model, "prompt": marker * 300}),  # over the context
        ("/chat/completions", {**chat, "response_format": _json_schema(schema)}),  # refused
        ("/chat/completions", {**chat, "stop": [marker] * 100}),  # over a cap
    ]
    statuses = [http.post(path, json=body).status_code for path, body in requests]
    broken = ('{"messages": [{"role": "user", "content": "' + marker + '"').encode()
    statuses.append(http.post("/chat/completions", content=broken).status_code)
    too_big = b'{"prompt": "' + marker.encode() * (64 * 1024 // len(marker)) + b'"}'
    statuses.append(http.post("/completions", content=too_big).status_code)
    wrong = {"Authorization": f"Bearer {WRONG_KEY}"}
    statuses.append(http.post("/chat/completions", json=chat, headers=wrong).status_code)
    # ignore_eos and 600 tokens (seconds of decoding on any CPU): the answer outlasts the client.
    long_answer = {**chat, "max_tokens": 600, "ignore_eos": True}
    _disconnect_mid_stream(http, {**long_answer, "stream": True})
    _disconnect_before_the_answer(http, long_answer)
    http.close()
    return statuses


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _disconnect_mid_stream(http: httpx.Client, body: dict) -> None:
    with http.stream("POST", "/chat/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk, then the client leaves


def _disconnect_before_the_answer(http: httpx.Client, body: dict) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post("/chat/completions", json=body, timeout=httpx.Timeout(120, read=0.5))


EXPECTED = [200, 200, 400, 400, 400, 400, 400, 400, 413, 401]


def test_no_log_line_holds_a_prompt_or_a_key(tmp_path: Path) -> None:
    marker = f"privacy-{uuid.uuid4().hex[:12]}"
    log_path = tmp_path / "server.log"
    with logging_server(log_path) as url:
        assert send_traffic(url, marker) == EXPECTED
        httpx.get(f"{url}/health", timeout=10)  # the aborts have landed by the next answer
    log = log_path.read_text()
    leaks = [line for line in log.splitlines() if marker in line]
    assert leaks == []
    assert API_KEY not in log and WRONG_KEY not in log
    # The log did record the traffic: one access line per answered request.
    access = [line for line in log.splitlines() if "kvshare.access" in line]
    assert len(access) >= len(EXPECTED)
    assert any("status=413" in line for line in access)


def test_with_log_prompts_on_the_marker_is_found(tmp_path: Path) -> None:
    """The control: the same search finds prompts when they are logged on purpose."""
    marker = f"privacy-{uuid.uuid4().hex[:12]}"
    log_path = tmp_path / "server.log"
    with logging_server(log_path, "--log-prompts", "true") as url:
        assert send_traffic(url, marker) == EXPECTED
    log = log_path.read_text()
    assert any(marker in line and "kvshare.access" in line for line in log.splitlines())
    assert API_KEY not in log and WRONG_KEY not in log
