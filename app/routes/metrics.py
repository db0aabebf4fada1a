"""GET /metrics: Prometheus text of the latest engine snapshot and the app's own series."""

from fastapi import APIRouter, Response

from app.metrics import CONTENT_TYPE
from app.routes.deps import State

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    # The engine pushed its figures already (ServerMetrics.observe_engine): nothing to fetch.
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
