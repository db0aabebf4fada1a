"""POST /v1/completions"""

from fastapi import APIRouter, Request, Response

from app.protocol import CompletionRequest
from app.routes.deps import AdmittedServing, Record, respond_to

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request, serving: AdmittedServing, record: Record
) -> Response:
    prepared = serving.prepare_completion(body, record)
    return await respond_to(request, serving, prepared, record, stream=bool(body.stream))
