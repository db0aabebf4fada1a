"""/v1/responses: POST served by the chat pipeline (`stream: true` as events); the stored
responses' GET, DELETE and input_items (app/responses/store.py), scoped to the tenant and
cache_salt. A streamed response is stored as a non-streamed one is."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.errors import APIError
from app.openai.formatting import ChoiceDelta
from app.openai.response_models import ChatCompletionResponse
from app.responses.request import ResponsesRequest
from app.responses.serving import (
    ResponsesStoreService,
    Turn,
    chain_items,
    chain_prefix,
    items_page,
    run_turn,
)
from app.responses.store import StoredResponse
from app.responses.stream import FinishResponse, ResponseStream, response_stream
from app.routes.deps import AdmittedServing, Record, ResponsesStore, get_state
from app.serving.records import Prepared, RequestRecord
from app.streaming import CLIENT_CLOSED_REQUEST, ClientDisconnected, cancel_on_disconnect
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
    body: ResponsesRequest,
    request: Request,
    serving: AdmittedServing,
    store: ResponsesStore,
    record: Record,
) -> Response:
    serving.check_tenant_before_prepare(record, body.user)  # a 429 costs no templating
    previous = await store.previous(body, record)
    with named_as_responses():
        chat_request = body.to_chat_request(chain_items(previous))
        prepared = await serving.prepare(chat_request, record, chain_prefix(previous))
        serving.check_tenant_limits(prepared, record)
        if body.stream:
            finish = _stored_finish(store, body, record, previous, prepared)
            stream = ResponseStream(serving, prepared, record, body, finish)
            keepalive_seconds = serving.settings.keepalive_seconds
            return response_stream(stream, keepalive_seconds, get_state(request).is_grace_over)
        try:  # a client that leaves aborts the turn in the engine; nothing is stored
            turn = await cancel_on_disconnect(request.receive, run_turn(serving, prepared, record))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(await store.finish(body, record, previous, turn))


def _stored_finish(
    store: ResponsesStoreService,
    body: ResponsesRequest,
    record: RequestRecord,
    previous: StoredResponse | None,
    prepared: Prepared,
) -> FinishResponse:
    """The streamed turn's terminal Response, made (and stored) as store.finish() makes a
    non-streamed one."""
    prompt_token_ids = list(prepared.engine_requests[0].prompt_token_ids)

    async def finish(
        chat: ChatCompletionResponse, deltas: list[ChoiceDelta], message_id: str
    ) -> dict[str, Any]:
        output_token_ids = [token_id for delta in deltas for token_id in delta.token_ids]
        turn = Turn(chat, prompt_token_ids, output_token_ids, message_id)
        return await store.finish(body, record, previous, turn)

    return finish


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
