"""POST /v1/responses (unstored), served by the chat pipeline; `stream: true` as events."""

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.errors import APIError
from app.responses_format import response_object
from app.responses_request import ResponsesRequest
from app.responses_stream import ResponseStream, response_stream
from app.routes.deps import AdmittedServing, Record, get_state
from engine.core.errors import ParamError

router = APIRouter()

# The chat field a translated value landed in -> the Responses field the client sent.
_FIELD_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
    "tool_choice": "tool_choice",
}


@contextmanager
def named_as_responses() -> Iterator[None]:
    """Errors of the translated chat request name the Responses fields the client sent."""
    try:
        yield
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        raise ParamError(_FIELD_NAMES.get(field, field), first["msg"]) from e
    except ParamError as e:
        raise ParamError(_FIELD_NAMES.get(e.param, e.param), e.message) from e
    except APIError as e:  # context length and the like name the chat field
        e.param = _FIELD_NAMES.get(e.param or "", e.param)
        raise


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, request: Request, serving: AdmittedServing, record: Record
) -> Response:
    with named_as_responses():
        prepared = await serving.prepare(body.to_chat_request(), record)
        serving.check_tenant_limits(prepared)
        if body.stream:
            stream = ResponseStream(serving, prepared, record, body)
            keepalive_seconds = serving.settings.keepalive_seconds
            return response_stream(stream, keepalive_seconds, get_state(request).is_grace_over)
        chat = await serving.complete(prepared, record)
    return JSONResponse(response_object(body, chat))
