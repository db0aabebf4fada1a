"""The OpenAI error envelope and the exception handlers that produce it.

Every error leaves as {"error": {"message", "type", "param", "code"}} with a matching status,
or on Anthropic's routes (ANTHROPIC_PREFIX) in Anthropic's envelope, {"type": "error",
"error": {"type", "message"}}, the message naming the field; a client never sees a stack
trace. ENGINE_ERRORS is the one table from the engine's error types (engine/core/errors.py,
plus ChatTemplateError) to statuses; handlers and the streaming path read it through
api_error().
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.errors import (
    EngineNotReady,
    FaultInjectionDisabled,
    InvalidFaultTarget,
    KVEventsDisabled,
    KVShareError,
    ParamError,
)
from engine.tokenizer import ChatTemplateError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
# Union members appear in pydantic error locations under these names; they are not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error type per status (its SDK raises one exception class per status).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error the client should read: raised anywhere below a route, rendered by a handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's envelope: a type by status; the message names the field."""
        status = self.status_code
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else INVALID_REQUEST)
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


class EngineError(APIError):
    """The engine failed this request (RequestOutput.error): a 500, the server keeps serving."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, type=SERVER_ERROR, code="engine_error")


@dataclass(frozen=True)
class ErrorStatus:
    """How one engine error type leaves over HTTP. `param` is reported when the error names
    none itself (a ParamError names its own); `prefix` goes before the error's message."""

    status: int
    type: str = INVALID_REQUEST
    code: str | None = None
    param: str | None = None
    prefix: str = ""


# Engine error type -> HTTP status; the most specific base class of an error wins
# (DuplicateRequest and UnknownFaultKind are ParamErrors).
ENGINE_ERRORS: dict[type[KVShareError], ErrorStatus] = {
    ParamError: ErrorStatus(400),
    ChatTemplateError: ErrorStatus(
        400, param="messages", prefix="The chat template rejected the messages: "
    ),
    FaultInjectionDisabled: ErrorStatus(403, code="fault_injection_disabled"),
    InvalidFaultTarget: ErrorStatus(409, code="no_fault_target"),
    KVEventsDisabled: ErrorStatus(404, code="kv_events_disabled"),
    EngineNotReady: ErrorStatus(503, type=SERVER_ERROR, code="not_ready"),
    KVShareError: ErrorStatus(
        500, type=SERVER_ERROR, code="engine_error", prefix="The engine failed this request: "
    ),
}


def api_error(exc: KVShareError) -> APIError:
    """The APIError an engine error becomes (ENGINE_ERRORS, by its nearest listed class)."""
    kind = next(ENGINE_ERRORS[cls] for cls in type(exc).__mro__ if cls in ENGINE_ERRORS)
    param = getattr(exc, "param", None) or kind.param
    return APIError(
        kind.status, kind.prefix + str(exc), type=kind.type, param=param, code=kind.code
    )


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error as the route at `path` speaks: Anthropic's envelope under ANTHROPIC_PREFIX."""
    body = error.anthropic_body() if path.startswith(ANTHROPIC_PREFIX) else error.body()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


def param_path(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as a field path, union-member names dropped.

    ('body', 'messages', 0, 'content', 'list[TextPart]', 1, 'type') -> messages[0].content[1].type;
    ('query', 'limit') -> limit
    """
    parts: list[str] = []
    items = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    for position, item in enumerate(items):
        if item == "[key]" or items[position + 1 : position + 2] == ["[key]"]:
            continue  # a mapping's bad key (and its marker) is no field name
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _FIELD_NAME.fullmatch(item) and item not in _TYPE_TAGS:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _preference(error: Mapping[str, Any]) -> tuple[bool, int, tuple[int, ...]]:
    loc = error["loc"]
    if not error["type"].endswith("_type"):
        return False, len(loc), ()
    return True, -len(loc), tuple(-item for item in loc if isinstance(item, int))


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The most useful pydantic error as a 400.

    A union reports one error per member; a wrong-type error ("*_type") only says that
    member did not apply, so an error from the member whose shape matched is preferred,
    then the shallowest. When every member failed on a type (requests are strict), the one
    that got furthest is meant: the deepest, then the one at the latest list index.
    """
    first = min(errors, key=_preference)
    kind, loc = first["type"], tuple(first["loc"])
    param = param_path(loc)
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}", code="invalid_json")
    if param is None:
        return APIError(400, "The request body must be a JSON object.", code="invalid_body")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        return APIError(400, message, param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    return APIError(400, f"Invalid value for '{param}': {first['msg']}", param=param)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.status_code == 500:  # 503 (loading, draining) is expected, not an error
        logger.error("request failed: %s", exc.message)
    return error_response(exc, request.url.path)


async def _request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(_validation_error(exc.errors()), request.url.path)


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KVShareError)
    return await _api_error(request, api_error(exc))


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        error = APIError(404, f"Unknown route: {request.url.path}", code="not_found")
    elif status == 400:  # FastAPI could not read the body (e.g. it is not UTF-8)
        message = f"The request body is not valid JSON: {exc.detail}"
        error = APIError(400, message, code="invalid_json")
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
        error = APIError(405, message, code="method_not_allowed")
    else:
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        error = APIError(status, str(exc.detail or phrase))
    error.headers.update(exc.headers or {})
    return error_response(error, request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    error = APIError(500, "Internal server error", type=SERVER_ERROR)
    return error_response(error, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    for engine_error in ENGINE_ERRORS:
        app.add_exception_handler(engine_error, _engine_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
