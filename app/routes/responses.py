"""POST /v1/responses (non-streaming, unstored), served by the chat pipeline."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.errors import APIError
from app.responses_format import response_object
from app.responses_request import ResponsesRequest
from app.routes.deps import AdmittedServing, Record
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


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, serving: AdmittedServing, record: Record
) -> JSONResponse:
    try:
        chat_request = body.to_chat_request()
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        raise ParamError(_FIELD_NAMES.get(field, field), first["msg"]) from e
    try:
        prepared = await serving.prepare(chat_request, record)
        chat = await serving.complete(prepared, record)
    except ParamError as e:
        raise ParamError(_FIELD_NAMES.get(e.param, e.param), e.message) from e
    except APIError as e:  # context length and the like name the chat field
        e.param = _FIELD_NAMES.get(e.param or "", e.param)
        raise
    return JSONResponse(response_object(body, chat))
