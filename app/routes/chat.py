"""POST /v1/chat/completions"""

from fastapi import APIRouter, Request, Response

from app.protocol import ChatCompletionRequest
from app.routes.deps import AdmittedServing, Record, respond_to

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, serving: AdmittedServing, record: Record
) -> Response:
    prepared = serving.prepare_chat(body, record)
    return await respond_to(request, serving, prepared, record, stream=bool(body.stream))
