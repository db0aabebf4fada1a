"""What routes share: the per-app ServerState and the dependencies that hand it out."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from app.errors import SERVER_ERROR, APIError
from app.metrics import ServerMetrics
from app.responses.serving import ResponsesStoreService
from app.responses.store import SqliteResponseStore, StoreLimits
from app.serving.limits import RequestLimits
from app.serving.records import RequestRecord, ServedModel
from app.serving.service import OpenAIServing
from app.settings import Settings
from engine.core.protocol import EngineClient
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05


class ServerState:
    """One app's state: readiness, draining, requests in flight, services once loaded.

    Lives on app.state.kvshare; touched only from the event loop.
    """

    def __init__(self, engine: EngineClient, settings: Settings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.serving: OpenAIServing | None = None
        self.is_draining = False
        self.is_grace_over = asyncio.Event()  # set when the drain's grace ends: streams end now
        self.num_in_flight = 0  # /v1/ requests not yet fully answered (see app/middleware.py)
        self.load_error: str | None = None
        self.responses: ResponsesStoreService | None = None  # open_store() .. close_store()

    async def open_store(self) -> None:
        """Open the response store (settings.store_path()); a store that cannot be opened
        stops the start: responses the server says it keeps must be kept."""
        server = self.settings.server
        limits = StoreLimits(
            server.store_max_responses, server.store_max_bytes, server.store_ttl_seconds
        )
        store = SqliteResponseStore(self.settings.store_path(), limits, self.metrics)
        await store.open()
        self.responses = ResponsesStoreService(store)

    async def close_store(self) -> None:
        if self.responses is not None:
            await self.responses.store.close()
            self.responses = None

    async def load(self) -> None:
        """Wait for the engine to be ready, then load the tokenizer and build the services.

        On failure it sets load_error, which stops a DrainingServer: a server whose model
        cannot load exits rather than answer /ready with 503 forever."""
        while not self.engine.is_ready:
            if self.engine.load_error is not None:
                self.load_error = self.engine.load_error
                logger.error("the model failed to load: %s", self.load_error)
                return
            await asyncio.sleep(_POLL_SECONDS)
        info = self.engine.model_info
        try:
            tokenizer = await asyncio.to_thread(self._load_tokenizer, info.tokenizer_path)
        except Exception as e:
            self.load_error = f"cannot load the tokenizer from {info.tokenizer_path}: {e}"
            logger.exception("the tokenizer failed to load")
            return
        name = self.settings.server.served_model_name or info.name
        model = ServedModel(name=name, info=info, tokenizer=tokenizer)
        limits = RequestLimits.of(self.settings.server, self.settings.engine)
        self.serving = OpenAIServing(
            self.engine,
            model,
            self.settings.server,
            self.metrics,
            limits=limits,
            stop=self.is_grace_over,
        )
        logger.info("ready: serving %s (context %d tokens)", name, info.max_model_len)

    def _load_tokenizer(self, tokenizer_path: str) -> Tokenizer:
        """The model's tokenizer, with server.chat_template's file as its template if set."""
        template_path = self.settings.server.chat_template
        if template_path is None:
            return Tokenizer(tokenizer_path)
        return Tokenizer(tokenizer_path, Path(template_path).read_text(encoding="utf-8"))

    def not_ready_reason(self) -> str | None:
        """None when requests can be served, else why not."""
        if self.is_draining:
            return "The server is shutting down."
        load_error = self.load_error or self.engine.load_error
        if load_error is not None:
            return f"The model failed to load: {load_error}"
        if self.serving is None:
            return "The model is still loading."
        if not self.engine.is_ready:
            return "The engine is not running."
        return None

    def ready_serving(self) -> OpenAIServing:
        reason = self.not_ready_reason()
        if reason is not None or self.serving is None:
            code = "draining" if self.is_draining else "not_ready"
            raise APIError(503, reason or "", type=SERVER_ERROR, code=code)
        return self.serving

    def admit(self) -> OpenAIServing:
        """The services for a new generation request: 503 while not ready, 429 when full."""
        serving = self.ready_serving()
        limit = self.settings.server.max_waiting_requests
        if self.engine.num_waiting >= limit:
            message = f"Too many requests are waiting ({limit}); retry shortly."
            retry = {"Retry-After": "1"}
            raise APIError(429, message, type="rate_limit_error", code="queue_full", headers=retry)
        return serving

    def begin_drain(self) -> None:
        """From now on /ready says 503 and new requests get 503; running ones go on."""
        if not self.is_draining:
            logger.info("draining: %d request(s) in flight", self.num_in_flight)
        self.is_draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_in_flight > 0:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_POLL_SECONDS)
        return True


def get_state(request: Request) -> ServerState:
    return request.app.state.kvshare


State = Annotated[ServerState, Depends(get_state)]


def get_ready_serving(state: State) -> OpenAIServing:
    return state.ready_serving()


def get_admitted_serving(state: State) -> OpenAIServing:
    return state.admit()


def get_responses_store(state: State) -> ResponsesStoreService:
    if state.responses is None:
        raise APIError(503, "The response store is not open.", type=SERVER_ERROR, code="not_ready")
    return state.responses


def get_record(request: Request) -> RequestRecord:
    record = getattr(request.state, "record", None)
    return record if record is not None else RequestRecord(request_id="-")


ReadyServing = Annotated[OpenAIServing, Depends(get_ready_serving)]
AdmittedServing = Annotated[OpenAIServing, Depends(get_admitted_serving)]
Record = Annotated[RequestRecord, Depends(get_record)]
ResponsesStore = Annotated[ResponsesStoreService, Depends(get_responses_store)]
