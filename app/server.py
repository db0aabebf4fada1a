"""create_app(engine_client, settings) -> FastAPI, and the uvicorn driver with graceful drain.

No module globals: everything an app needs hangs off app.state.kvshare (a ServerState).
The ASGI middlewares here are plain ASGI (not BaseHTTPMiddleware) so that streaming
responses and disconnect messages pass through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import anyio
import uvicorn
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_response, install_error_handlers
from app.metrics import ServerMetrics
from app.openapi import OPERATOR_PATHS, install_openapi
from app.routes import (
    chat,
    completions,
    debug,
    health,
    messages,
    metrics,
    models,
    responses,
    tokens,
)
from app.routes.deps import ServerState
from app.serving import RequestRecord
from app.settings import Settings
from engine.core.protocol import EngineClient

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("kvshare.access")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_GENERATION_PREFIX = "/v1/"
# Routes that need an API key, when keys are set (also app/openapi.py's KEYED_PREFIXES),
# but the operator's: those need an operator key (docs/security.md).
_KEYED_PREFIXES = (_GENERATION_PREFIX, "/debug/", "/tokenize", "/detokenize")


def create_app(engine_client: EngineClient, settings: Settings) -> FastAPI:
    """An app serving `engine_client`. Its lifespan starts the engine and shuts it down."""
    state = ServerState(engine_client, settings, ServerMetrics(settings.server.max_tenant_labels))
    engine_client.add_stats_listener(state.metrics.observe_engine)  # pushed once per step
    app = FastAPI(
        title="kvshare",
        summary="OpenAI-compatible LLM server with a shared, isolated KV cache",
        lifespan=_lifespan(state),
        middleware=_middleware(state),
    )
    app.state.kvshare = state
    install_error_handlers(app)
    for module in (chat, completions, models, health, metrics, debug, responses, tokens, messages):
        app.include_router(module.router)
    install_openapi(app, settings)
    return app


def _middleware(state: ServerState) -> list[Middleware]:
    server = state.settings.server
    stack = [Middleware(RequestContextMiddleware, state=state)]
    if server.cors_allow_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(server.cors_allow_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=[
                    *("Authorization", "Content-Type", "X-Request-Id"),
                    *("X-Api-Key", "Anthropic-Version", "Anthropic-Beta"),
                ],
            )
        )
    if server.api_keys:
        stack.append(Middleware(ApiKeyMiddleware, api_keys=server.api_keys))
    if server.api_keys or server.operator_keys:
        stack.append(Middleware(OperatorKeyMiddleware, operator_keys=server.operator_keys))
    stack.append(Middleware(BodyLimitMiddleware, max_body_bytes=server.max_body_bytes))
    return stack


def _lifespan(state: ServerState):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.open_store()
        await state.engine.start()
        loader = asyncio.ensure_future(state.load())
        try:
            yield
        finally:
            state.begin_drain()
            with anyio.CancelScope(shield=True):
                loader.cancel()
                await asyncio.gather(loader, return_exceptions=True)
                await state.engine.shutdown()
                await state.close_store()

    return lifespan


# -- middleware -------------------------------------------------------------------------------


class RequestContextMiddleware:
    """X-Request-Id in and out, the RequestRecord, in-flight counting, one access-log line."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        record = RequestRecord(request_id=request_id)
        scope.setdefault("state", {})["record"] = record
        status = 500  # if the app raises before it starts a response
        counted = scope["path"].startswith(_GENERATION_PREFIX)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        start = time.monotonic()
        self.state.num_in_flight += counted
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.state.num_in_flight -= counted
            if record.ticket is not None:  # admitted, but its run() may never have started
                record.ticket.leave(record.completion_tokens)
            self._log(scope, status, record, time.monotonic() - start)

    def _log(self, scope: Scope, status: int, record: RequestRecord, duration_s: float) -> None:
        fields = {
            "request_id": record.request_id,
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "cached_tokens": record.cached_tokens,
            "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 4),
            "duration_s": round(duration_s, 4),
            "finish_reason": record.finish_reason,
        }
        if record.prompt is not None:  # set only with log_prompts
            fields["prompt"] = record.prompt
        text = " ".join(f"{key}={value}" for key, value in fields.items() if key != "prompt")
        if record.prompt is not None:
            text += f" prompt={record.prompt!r}"
        access_logger.info(text, extra={"fields": fields})


class ApiKeyMiddleware:
    """401 for /v1/ and /debug/ requests without a valid key: `Authorization: Bearer <key>`
    or, as Anthropic's clients send it, `x-api-key: <key>` (the same keys, the same tenants)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if not path.startswith(_KEYED_PREFIXES) or path in OPERATOR_PATHS:
            await self.app(scope, receive, send)
            return
        key = _matching_key(scope, self.api_keys)
        record = scope.get("state", {}).get("record")
        if key is not None and record is not None:
            # One tenant per key: its prefix-cache namespace never shares blocks with another's.
            record.tenant = hashlib.sha256(key).hexdigest()[:16]
        if key is None:
            message = (
                "Invalid or missing API key. Send it as `Authorization: Bearer <key>` "
                "or `x-api-key: <key>`."
            )
            headers = {"WWW-Authenticate": "Bearer"}
            error = APIError(401, message, code="invalid_api_key", headers=headers)
            await error_response(error, scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


class OperatorKeyMiddleware:
    """The operator's routes (OPERATOR_PATHS): with operator_keys set, 401 without one of
    them; without, on a server with tenants (api_keys), /debug/faults and /debug/kv_blocks
    answer 403 (no tenant may drill the cache or read every tenant's block hashes) and
    /metrics shows its tenant view (app/routes/metrics.py)."""

    def __init__(self, app: ASGIApp, operator_keys: tuple[str, ...]) -> None:
        self.app = app
        self.operator_keys = [key.encode() for key in operator_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path not in OPERATOR_PATHS:
            await self.app(scope, receive, send)
            return
        error = None
        if self.operator_keys and _matching_key(scope, self.operator_keys) is None:
            message = (
                "This route needs an operator key (operator_keys): send it as "
                "`Authorization: Bearer <key>` or `x-api-key: <key>`."
            )
            headers = {"WWW-Authenticate": "Bearer"}
            error = APIError(401, message, code="invalid_operator_key", headers=headers)
        elif not self.operator_keys and path != "/metrics":
            message = "This route is the operator's: set operator_keys to use it."
            error = APIError(403, message, code="operator_only")
        if error is not None:
            await error_response(error, path)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _matching_key(scope: Scope, keys: list[bytes]) -> bytes | None:
    """The key of `keys` the request sends as `Authorization: Bearer <key>` or `x-api-key`."""
    header = _header(scope, b"authorization") or ""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        token = _header(scope, b"x-api-key") or ""
    given = token.strip().encode()
    # Compare with every key, always: the time taken says nothing about which one matched.
    matches = [hmac.compare_digest(given, key) for key in keys]
    if not given or not any(matches):
        return None
    return keys[matches.index(True)]


class BodyLimitMiddleware:
    """413 for a body over max_body_bytes: by Content-Length, and by counting what arrives.

    The body is read here (it is small by construction) and replayed to the app; after it,
    receive() passes through so that the app still sees http.disconnect.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay([replayed], receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"The request body is larger than the limit of {self.max_body_bytes} bytes."
        error = APIError(413, message, code="request_too_large")
        await error_response(error, scope["path"])(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed_receive() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed_receive


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


# -- logging ----------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line; access-log fields (record.fields) become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update(getattr(record, "fields", {}))
        if record.exc_info:
            data["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(data, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """Root logging for the process (the CLI calls this once)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# -- serving with a graceful drain -------------------------------------------------------------


_LAST_EVENT_SECONDS = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT drains first.

    First signal: /ready turns 503 and new requests get 503, running ones may finish for
    shutdown_grace_seconds; then streams still running end with an error event and [DONE],
    uvicorn shuts down (cancelling what is left, which aborts it in the engine) and the
    lifespan shuts the engine down. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.begin_shutdown)
                installed.append(sig)
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def begin_shutdown(self) -> None:
        """Start the drain; called again, exit now."""
        if self._drain_task is not None:
            self.should_exit = self.force_exit = True
            return
        self.state.begin_drain()
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        grace = self.state.settings.server.shutdown_grace_seconds
        if not await self.state.wait_idle(grace):
            logger.warning("grace period over: ending %d request(s)", self.state.num_in_flight)
            self.state.is_grace_over.set()
            # A moment for the streams to send their last event: a cut stream has none.
            await self.state.wait_idle(_LAST_EVENT_SECONDS)
        self.should_exit = True


def build_server(app: FastAPI, settings: Settings) -> DrainingServer:
    """A uvicorn server for `app` (access logs are ours, one line per request)."""
    server = settings.server
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=1,  # after our own grace period
        lifespan="on",
    )
    return DrainingServer(config, app.state.kvshare)
