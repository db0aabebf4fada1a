"""The OpenAI error envelope and the exception handlers that produce it.

Every error leaves as {"error": {"message", "type", "param", "code"}} with a matching status;
a client never sees a stack trace.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.sampling_params import ParamError
from engine.tokenizer import ChatTemplateError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
# Union members appear in pydantic error locations under these names; they are not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


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


class EngineError(APIError):
    """The engine failed this request (RequestOutput.error): a 500, the server keeps serving."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, type=SERVER_ERROR, code="engine_error")


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def param_path(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location as a field path, union-member names dropped.

    ('body', 'messages', 0, 'content', 'list[TextPart]', 1, 'type') -> messages[0].content[1].type
    """
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item == "[key]" and parts:
            parts.pop()  # the bad key itself is not a field name
        elif _FIELD_NAME.fullmatch(item) and item not in _TYPE_TAGS:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The most useful pydantic error as a 400.

    A union reports one error per member; a wrong-type error ("*_type") only says that
    member did not apply, so an error from the member whose shape matched is preferred,
    then the shallowest.
    """
    first = min(errors, key=lambda e: (e["type"].endswith("_type"), len(e["loc"])))
    kind, loc = first["type"], tuple(first["loc"])
    param = param_path(loc)
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}", code="invalid_json")
    if param is None:
        return APIError(400, "The request body must be a JSON object.", code="invalid_body")
    if param.startswith("response_format"):
        message = 'response_format: only {"type": "text"} is supported (no JSON mode or schema).'
        return APIError(400, message, param="response_format", code="unsupported_parameter")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        return APIError(400, message, param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param)
    return APIError(400, f"Invalid value for '{param}': {first['msg']}", param=param)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.status_code == 500:  # 503 (loading, draining) is expected, not an error
        logger.error("request failed: %s", exc.message)
    return error_response(exc)


async def _request_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(_validation_error(exc.errors()))


async def _param_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ParamError)
    return error_response(APIError(400, exc.message, param=exc.param))


async def _chat_template_error(_: Request, exc: Exception) -> JSONResponse:
    message = f"The chat template rejected the messages: {exc}"
    return error_response(APIError(400, message, param="messages"))


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        error = APIError(404, f"Unknown route: {request.url.path}", code="not_found")
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
        error = APIError(405, message, code="method_not_allowed")
    else:
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        error = APIError(status, str(exc.detail or phrase))
    error.headers.update(exc.headers or {})
    return error_response(error)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(APIError(500, "Internal server error", type=SERVER_ERROR))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(ParamError, _param_error)
    app.add_exception_handler(ChatTemplateError, _chat_template_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)
