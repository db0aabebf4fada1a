"""GET /metrics: Prometheus text, engine numbers refreshed at scrape time."""

import logging

from fastapi import APIRouter, Response

from app.metrics import CONTENT_TYPE
from app.routes.deps import State

router = APIRouter()
logger = logging.getLogger(__name__)


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    try:
        stats = state.engine.stats()
    except Exception:  # a broken engine must not break the scrape of everything else
        logger.exception("engine stats unavailable")
    else:
        state.metrics.refresh(stats)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
