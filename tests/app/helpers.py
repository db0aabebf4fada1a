"""Helpers the HTTP tests share: an in-process client with the app's lifespan, SSE parsing."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from fake_engine import FakeEngine
from fastapi import FastAPI

import app.openai.json_schema
from app.server import create_app
from app.settings import ServerSettings, Settings

MODEL = "fake-model"


def make_settings(**server: object) -> Settings:
    return Settings(server=ServerSettings(**server))


async def wait_ready(app: FastAPI, timeout_s: float = 5.0) -> None:
    """Let the lifespan's loader build the services (it polls the engine)."""
    with anyio.fail_after(timeout_s):
        while app.state.kvshare.serving is None:
            await anyio.sleep(0.01)


@contextlib.asynccontextmanager
async def open_client(
    engine: FakeEngine, settings: Settings | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client over create_app(engine, settings), lifespan included.

    httpx's ASGITransport collects a whole response before returning it, streamed or not.
    """
    app = create_app(engine, settings or make_settings())
    async with app.router.lifespan_context(app):
        if engine.is_ready:
            await wait_ready(app)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvshare") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


def sse_data(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments and blank lines dropped)."""
    payloads = []
    for event in (block for block in body.split("\n\n") if block.strip()):
        lines = [line for line in event.split("\n") if not line.startswith(":")]
        if lines:
            assert all(line.startswith("data: ") for line in lines), event
            payloads.append("\n".join(line[len("data: ") :] for line in lines))
    return payloads


def sse_chunks(body: str) -> list[dict]:
    """The JSON chunks of an SSE body; asserts that it ends with exactly one [DONE]."""
    payloads = sse_data(body)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(payload) for payload in payloads[:-1]]


def chat_body(content: str = "hi", **fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def streamed_text(chunks: list[dict], index: int = 0, key: str = "content") -> str:
    """Concatenated chat delta content (key="content") or completion text (key="text")."""
    parts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] == index:
                parts.append(choice["delta"].get(key, "") if key == "content" else choice["text"])
    return "".join(parts)


def assert_aborted_at_the_pause(app, engine: FakeEngine) -> str:
    """The one request was aborted while the engine held it, its stream closed, nothing is in
    flight; returns the app's /metrics text."""
    request_id = engine.requests[0].request_id
    assert engine.aborts == [(request_id, None)]
    assert engine.closed == [request_id]
    assert app.state.kvshare.num_in_flight == 0
    return app.state.kvshare.metrics.render().decode()


async def post_then_disconnect(
    app, path: str, body: dict, disconnect, sent: list[dict], headers=(), send_override=None
) -> None:
    """POST `body` to `path` straight through the ASGI app; the client disconnects when the
    `disconnect` event is set. Messages the app sends go to `sent` (or `send_override`)."""
    data = json.dumps(body).encode()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("kvshare", 80),
    }
    await app(scope, receive, send_override or send)


def spy_schema_serializations(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What app/openai/json_schema.py serializes from now on (every canonical schema text is its
    json.dumps), in order: a request's schema should appear once."""
    dumped: list[object] = []

    class CountingJson:
        @staticmethod
        def dumps(value: object, **kwargs: object) -> str:
            dumped.append(value)
            return json.dumps(value, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(app.openai.json_schema, "json", CountingJson)
    return dumped
