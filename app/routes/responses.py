"""/v1/responses: POST (non-streaming) served by the chat pipeline; the stored responses'
GET, DELETE and input_items (app/response_store.py), scoped to the tenant and cache_salt."""

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.errors import APIError
from app.responses_request import ResponsesRequest
from app.responses_serving import chain_items, chain_prefix, items_page, run_turn
from app.routes.deps import AdmittedServing, Record, ResponsesStore
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
# cache_salt narrows the store's scope as it narrows the prefix cache (a query parameter here).
CacheSalt = Annotated[str | None, Query(description="The cache_salt the response was made with.")]


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, serving: AdmittedServing, store: ResponsesStore, record: Record
) -> JSONResponse:
    previous = await store.previous(body, record)
    try:
        chat_request = body.to_chat_request(chain_items(previous))
    except ValidationError as e:
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        raise ParamError(_FIELD_NAMES.get(field, field), first["msg"]) from e
    try:
        prepared = await serving.prepare(chat_request, record, chain_prefix(previous))
        turn = await run_turn(serving, prepared, record)
    except ParamError as e:
        raise ParamError(_FIELD_NAMES.get(e.param, e.param), e.message) from e
    except APIError as e:  # context length and the like name the chat field
        e.param = _FIELD_NAMES.get(e.param or "", e.param)
        raise
    return JSONResponse(await store.finish(body, record, previous, turn))


@router.get("/v1/responses/{response_id}", response_model=None)
async def get_response(
    response_id: str, store: ResponsesStore, record: Record, cache_salt: CacheSalt = None
) -> JSONResponse:
    stored = await store.retrieve(record, cache_salt, response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", response_model=None)
async def delete_response(
    response_id: str, store: ResponsesStore, record: Record, cache_salt: CacheSalt = None
) -> JSONResponse:
    return JSONResponse(await store.delete(record, cache_salt, response_id))


@router.get("/v1/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str,
    store: ResponsesStore,
    record: Record,
    cache_salt: CacheSalt = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
    include: Annotated[list[str] | None, Query()] = None,
) -> JSONResponse:
    if include:
        raise ParamError("include", f"include: {include[0]!r} is not supported")
    stored = await store.retrieve(record, cache_salt, response_id)
    return JSONResponse(items_page(stored.input_items, limit, order, after, before))
