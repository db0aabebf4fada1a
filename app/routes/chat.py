"""POST /v1/chat/completions"""

from fastapi import APIRouter, Request, Response

from app.openai.request_models import ChatCompletionRequest
from app.openai.response_models import ChatCompletionChunk, ChatCompletionResponse
from app.openapi import stream_responses
from app.routes.deps import AdmittedServing, Record

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses=stream_responses(ChatCompletionResponse, ChatCompletionChunk),
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, serving: AdmittedServing, record: Record
) -> Response:
    serving.check_tenant_before_prepare(record, body.user)  # a 429 costs no templating
    prepared = await serving.prepare(body, record)  # in a worker thread
    return await serving.respond(request, prepared, record, stream=bool(body.stream))
