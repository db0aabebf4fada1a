"""GET /health (the process is alive) and GET /ready (the model is loaded, not draining)."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.errors import SERVER_ERROR, APIError, error_response
from app.routes.deps import State

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(state: State) -> JSONResponse | dict[str, str]:
    reason = state.not_ready_reason()
    if reason is not None:
        code = "draining" if state.is_draining else "not_ready"
        return error_response(APIError(503, reason, type=SERVER_ERROR, code=code))
    return {"status": "ready"}
