"""GET /metrics: Prometheus text of the latest engine snapshot and the app's own series."""

from fastapi import APIRouter, Response

from app.metrics import CONTENT_TYPE
from app.routes.deps import State

router = APIRouter()


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    """Everything for the operator (and the single user); on a server with tenants but no
    operator keys, anyone may scrape, so the tenant view (ServerMetrics.render)."""
    server = state.settings.server
    tenant_view = bool(server.api_keys) and not server.operator_keys
    # The engine pushed its figures already (ServerMetrics.observe_engine): nothing to fetch.
    return Response(state.metrics.render(tenant_view), media_type=CONTENT_TYPE)
