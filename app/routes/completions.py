"""POST /v1/completions"""

from fastapi import APIRouter, Request, Response

from app.openai.request_models import CompletionRequest
from app.openai.response_models import CompletionResponse
from app.openapi import stream_responses
from app.routes.deps import AdmittedServing, Record

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=None,
    responses=stream_responses(CompletionResponse, CompletionResponse),
)
async def create_completion(
    body: CompletionRequest, request: Request, serving: AdmittedServing, record: Record
) -> Response:
    serving.check_tenant_before_prepare(record, body.user)  # a 429 costs no templating
    prepared = await serving.prepare(body, record)  # in a worker thread
    return await serving.respond(request, prepared, record, stream=bool(body.stream))
