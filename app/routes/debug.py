"""POST /debug/faults: fault drills for the prefix-cache auditor (off by default).
GET /debug/kv_blocks: the KV event hashes of every cached block (only with KV events on).

Only a server started with --enable-fault-injection (engine key enable_fault_injection) acts
on it; any other answers 403 with an OpenAI error body. It is the operator's: with
operator_keys it needs one of them, with api_keys alone it answers 403 (app/middleware.py
OperatorKeyMiddleware, docs/security.md). The engine's refusals (FaultInjectionDisabled,
InvalidFaultTarget, EngineNotReady) become statuses through app/errors.py's ENGINE_ERRORS.

/debug/kv_blocks is the reference a KV event subscriber can check its rebuilt set against
(engine/kv_event_publisher.py); a server without kv_events_endpoint answers 404 with an OpenAI
error body. It is read-only, and the operator's like /debug/faults.

GET /debug/cache_report: where the calling tenant's recent prompts diverge from each other,
with a plain-language finding (docs/cache-diagnostics.md); keyed like the others, and only
ever about the caller's own tenant. 404 when server.cache_history_size is 0.
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from app.diagnostics.cache import RecentPrompt
from app.diagnostics.cache_report import build_report
from app.errors import APIError
from app.routes.deps import ReadyServing, Record, State
from app.serving.records import diagnostics_scope
from engine.core.errors import FaultInjectionDisabled
from engine.core.protocol import FAULT_KINDS
from engine.tokenizer import Tokenizer

router = APIRouter()
logger = logging.getLogger(__name__)


class FaultRequest(BaseModel):
    """corrupt_block: overwrite a cached block's K/V with noise. wrong_block: exchange the K/V
    of two cached blocks, so each one's tokens map to the other's KV. Targets default to the
    first block of the most recently used cached prefix (and, for wrong_block, a block off it).
    See engine/audit/faults.py."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal[FAULT_KINDS]
    block_id: int | None = Field(default=None, ge=0)
    other_block_id: int | None = Field(default=None, ge=0)


class FaultResponse(BaseModel):
    kind: str
    block_ids: list[int]
    detail: str


def require_fault_injection(state: State) -> None:
    """Runs before the body is validated: a disabled server says 403 to any request."""
    if not state.settings.engine.enable_fault_injection:
        message = "Fault injection is disabled; start the server with --enable-fault-injection."
        raise FaultInjectionDisabled(message)


@router.post("/debug/faults", dependencies=[Depends(require_fault_injection)])
async def inject_fault(body: FaultRequest, state: State) -> FaultResponse:
    state.ready_serving()  # 503 while loading or draining
    report = await state.engine.inject_fault(body.kind, body.block_id, body.other_block_id)
    logger.warning("fault drill: %s", report.detail)
    return FaultResponse(kind=report.kind, block_ids=report.block_ids, detail=report.detail)


class KVBlocksResponse(BaseModel):
    block_hashes: list[int]  # sorted; unsigned 64-bit, as in the events


def require_kv_events(state: State) -> None:
    if not state.settings.engine.kv_events_endpoint:
        message = "KV events are disabled; start the server with --kv-events-endpoint."
        raise APIError(404, message, code="kv_events_disabled")


@router.get("/debug/kv_blocks", dependencies=[Depends(require_kv_events)])
async def list_kv_blocks(state: State) -> KVBlocksResponse:
    state.ready_serving()  # 503 while loading or draining
    return KVBlocksResponse(block_hashes=await state.engine.kv_block_hashes())


def require_cache_history(state: State) -> None:
    if state.settings.server.cache_history_size == 0:
        message = "The cache report is off; set server.cache_history_size above 0."
        raise APIError(404, message, code="cache_report_disabled")


@router.get("/debug/cache_report", dependencies=[Depends(require_cache_history)])
async def cache_report(
    serving: ReadyServing,
    record: Record,
    cache_salt: Annotated[str | None, Query(description="The cache_salt of the prompts.")] = None,
) -> dict:
    """Where the caller's recent prompts (its tenant's, of this cache_salt) diverge; see
    app/diagnostics/cache_report.py. Rendering the segments and comparing run in a worker thread."""
    prompts = serving.recent_prompts.prompts_of(diagnostics_scope(record.tenant, cache_salt))
    block_size = serving.engine.stats().block_size
    return await anyio.to_thread.run_sync(report_of, prompts, serving.model.tokenizer, block_size)


def report_of(prompts: list[RecentPrompt], tokenizer: Tokenizer, block_size: int) -> dict:
    """build_report() of `prompts`, the last one's segments rendered first (blocking)."""
    segments = prompts[-1].segments(tokenizer) if prompts else []
    ids = [prompt.token_ids for prompt in prompts]
    return build_report(ids, segments, tokenizer, block_size)
