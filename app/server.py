"""create_app(engine_client, settings) -> FastAPI, and the uvicorn driver with graceful drain.

No module globals: everything an app needs hangs off app.state.kvshare (a ServerState). The
middlewares it installs live in app/middleware.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime

import anyio
import uvicorn
from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from app.errors import install_error_handlers
from app.metrics import ServerMetrics
from app.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    OperatorKeyMiddleware,
    RequestContextMiddleware,
)
from app.openapi import install_openapi
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
from app.settings import Settings
from engine.core.protocol import EngineClient

logger = logging.getLogger(__name__)


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
    """uvicorn.Server whose SIGTERM/SIGINT drains first, and which stops by itself when the
    model fails to load (load_error says why once serve() has returned).

    First signal: /ready turns 503 and new requests get 503, running ones may finish for
    shutdown_grace_seconds; then streams still running end with an error event and [DONE],
    uvicorn shuts down (cancelling what is left, which aborts it in the engine) and the
    lifespan shuts the engine down. A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def load_error(self) -> str | None:
        """Why the model (or its tokenizer) failed to load, if it did."""
        return self.state.load_error

    async def on_tick(self, counter: int) -> bool:
        """uvicorn asks every 0.1 s whether to exit: also once the model has failed to load,
        since a server that can never be ready should not look alive."""
        if self.load_error is not None:
            return True
        return await super().on_tick(counter)

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
