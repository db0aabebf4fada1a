"""POST /v1/responses/input_tokens, POST /tokenize, POST /detokenize (app/openai/tokenization.py).

Ready, not queued: they take no slot in the engine's queue and no tenant namespace, but a
place in their tenant's load while they work (serving.tenant_slot: the per-tenant limits'
429), as templating a large body costs what a generation's does; input_tokens reads the
tenant's response store for a previous_response_id.
"""

from typing import Any

import anyio
from fastapi import APIRouter

from app.openai.tokenization import (
    DetokenizeRequest,
    InputTokensRequest,
    TokenizeRequest,
    count_input_tokens,
    detokenize,
    tokenize,
)
from app.routes.deps import ReadyServing, Record, ResponsesStore
from app.routes.responses import named_as_responses

router = APIRouter()


@router.post("/v1/responses/input_tokens")
async def create_input_tokens(
    body: InputTokensRequest, serving: ReadyServing, store: ResponsesStore, record: Record
) -> dict[str, Any]:
    with named_as_responses(), serving.tenant_slot(record):
        request = body.to_responses_request(serving.model.name)
        previous = await store.previous(request, record)  # the chain POST /v1/responses continues
        return await anyio.to_thread.run_sync(count_input_tokens, serving, request, previous)


@router.post("/tokenize")
async def create_tokenize(
    body: TokenizeRequest, serving: ReadyServing, record: Record
) -> dict[str, Any]:
    with serving.tenant_slot(record):
        return await anyio.to_thread.run_sync(tokenize, serving, body)


@router.post("/detokenize")
async def create_detokenize(
    body: DetokenizeRequest, serving: ReadyServing, record: Record
) -> dict[str, Any]:
    with serving.tenant_slot(record):
        return await anyio.to_thread.run_sync(detokenize, serving, body)
