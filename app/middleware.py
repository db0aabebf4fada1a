"""The server's ASGI middlewares: request context and access log, API and operator keys,
the body limit.

Plain ASGI (not BaseHTTPMiddleware), so streaming responses and disconnect messages pass
through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_response
from app.openapi import KEYED_PREFIXES, OPERATOR_PATHS
from app.routes.deps import ServerState
from app.serving.records import RequestRecord

access_logger = logging.getLogger("kvshare.access")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_GENERATION_PREFIX = "/v1/"  # the routes counted in flight


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
    """401 for keyed routes (KEYED_PREFIXES) without a valid key, sent as `Authorization:
    Bearer <key>` or, as Anthropic's clients do, `x-api-key: <key>`; one tenant per key."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if not path.startswith(KEYED_PREFIXES) or path in OPERATOR_PATHS:
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
    """The operator's routes (OPERATOR_PATHS): 401 without an operator key when operator_keys
    are set. Without them no tenant may drill the cache or read every tenant's block hashes:
    those /debug/ routes answer 403, /metrics shows its tenant view (app/routes/metrics.py)."""

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
