"""The Responses API over the chat services and a ResponseStore: one turn, stored or not,
continued from a stored chain; and what GET / DELETE read of the store."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import APIError
from app.openai.response_models import ChatCompletionResponse
from app.responses.chain import item_resources
from app.responses.format import response_object
from app.responses.request import ResponsesRequest
from app.responses.store import ResponseStore, StoredResponse, scope_of
from app.serving.records import Prepared, RequestRecord
from app.serving.service import OpenAIServing

logger = logging.getLogger(__name__)


def not_found(response_id: str, param: str | None = None) -> APIError:
    """An unknown, deleted, expired or other tenant's response: all read alike."""
    message = f"No response with id {response_id!r} found."
    return APIError(404, message, param=param, code="response_not_found")


@dataclass
class Turn:
    """One generation: the chat response and the token ids it ran on and produced
    (message_id: the id a stream already gave its message item)."""

    chat: ChatCompletionResponse
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    message_id: str | None = None


async def run_turn(serving: OpenAIServing, prepared: Prepared, record: RequestRecord) -> Turn:
    """serving.complete(), keeping the output token ids (the next turn's prompt starts with
    them; EOS included when the model ended the answer)."""
    deltas = [delta async for delta in serving.run(prepared, record)]
    chat = prepared.formatter.response(prepared.num_choices, deltas, record.usage())
    assert isinstance(chat, ChatCompletionResponse)
    output_token_ids = [token_id for delta in deltas for token_id in delta.token_ids]
    return Turn(chat, list(prepared.engine_requests[0].prompt_token_ids), output_token_ids)


class ResponsesStoreService:
    """The store side of /v1/responses; every read and write is scoped to the request's
    tenant (API key) and cache_salt."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def previous(
        self, body: ResponsesRequest, record: RequestRecord
    ) -> StoredResponse | None:
        """The response previous_response_id continues (404 naming the field if unknown)."""
        if body.previous_response_id is None:
            return None
        scope = scope_of(record.tenant, body.cache_salt)
        stored = await self.store.get(scope, body.previous_response_id)
        if stored is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        return stored

    async def finish(
        self,
        body: ResponsesRequest,
        record: RequestRecord,
        previous: StoredResponse | None,
        turn: Turn,
    ) -> dict[str, Any]:
        """The Response object of `turn`, stored when the request asks (store says whether)."""
        response = response_object(body, turn.chat, turn.message_id)
        if not body.is_stored:
            return response
        stored = StoredResponse(
            response["id"],
            response,
            chain_items(previous) + item_resources(body.input),
            turn.prompt_token_ids,
            turn.output_token_ids,
        )
        try:
            is_kept = await self.store.put(scope_of(record.tenant, body.cache_salt), stored)
        except Exception:
            logger.exception("the response store failed to keep %s", response["id"])
            is_kept = False
        if not is_kept:
            response = {**response, "store": False}
        return response

    async def retrieve(
        self, record: RequestRecord, cache_salt: str | None, response_id: str
    ) -> StoredResponse:
        stored = await self.store.get(scope_of(record.tenant, cache_salt), response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    async def delete(
        self, record: RequestRecord, cache_salt: str | None, response_id: str
    ) -> dict[str, Any]:
        if not await self.store.delete(scope_of(record.tenant, cache_salt), response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def chain_items(previous: StoredResponse | None) -> list[dict[str, Any]]:
    """The items a continuation of `previous` starts from: what it was generated from, then
    its output (messages and function calls)."""
    if previous is None:
        return []
    return previous.input_items + previous.response["output"]


def chain_prefix(previous: StoredResponse | None) -> list[int] | None:
    """The token ids a continuation's prompt should start with (prompt + output)."""
    if previous is None:
        return None
    return previous.prompt_token_ids + previous.output_token_ids


def items_page(
    items: list[dict[str, Any]],
    limit: int,
    order: Literal["asc", "desc"],
    after: str | None,
    before: str | None,
) -> dict[str, Any]:
    """The spec's ResponseItemList: `limit` items in `order`, strictly after the item `after`
    and before the item `before` (ids in that order; an unknown id: a 400 naming it)."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise APIError(400, f"{name}: no input item with id {cursor!r}", param=name)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    window = ordered[start:end]
    page = window[:limit]
    return {
        "object": "list",
        "data": page,
        "has_more": len(window) > limit,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
