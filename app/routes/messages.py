"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API on the chat
pipeline (app/anthropic/). `?beta=true` (the SDK's beta client) and the anthropic-version and
anthropic-beta headers are accepted and change nothing; errors leave in Anthropic's envelope
(app/errors.py), naming the Anthropic field."""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.anthropic.message import (
    DiagnosticsAsked,
    MessageStream,
    message_id_of,
    message_stream,
    run_message,
)
from app.anthropic.request import (
    VOLATILE_SYSTEM_LINE,
    MessagesConversation,
    MessagesParamError,
    MessagesRequest,
    chat_id_of,
)
from app.diagnostics.cache import wants_diagnostics
from app.errors import APIError, param_path
from app.openai.request_models import CacheDiagnosticsOptions
from app.routes.deps import AdmittedServing, ReadyServing, Record, get_state
from app.serving.records import RequestRecord, diagnostics_scope
from app.serving.service import OpenAIServing
from app.streaming import (
    CLIENT_CLOSED_REQUEST,
    SSE_EVENT_SCHEMA,
    ClientDisconnected,
    cancel_on_disconnect,
)
from engine.core.errors import ParamError

router = APIRouter()

Beta = Annotated[bool | None, Query(description="Sent by the SDK's beta client; no effect.")]
# The chat field a translated value landed in -> the Messages field the client sent.
_FIELD_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "response_format": "output_config.format",
}
_CHAT_TOOL = re.compile(r"^tools\[(\d+)\]\.function\.parameters")
_CHAT_MESSAGE = re.compile(r"^messages\[\d+\].*")  # chat messages are not the client's turns


def messages_param(param: str | None) -> str | None:
    if param is None:
        return None
    param = _CHAT_TOOL.sub(r"tools[\1].input_schema", param)
    param = _CHAT_MESSAGE.sub("messages", param)
    return _FIELD_NAMES.get(param, param)


@contextmanager
def named_as_messages() -> Iterator[None]:
    """Errors of the translated chat request name the Messages fields the client sent."""
    try:
        yield
    except MessagesParamError:
        raise
    except ValidationError as e:
        first = e.errors()[0]
        param = messages_param(param_path(first["loc"])) or "messages"
        raise ParamError(param, f"{param}: {first['msg']}") from e
    except ParamError as e:
        param = messages_param(e.param) or "messages"
        raise ParamError(param, e.message.replace(e.param or "", param, 1)) from e
    except APIError as e:  # context length and the like name the chat field
        e.param = messages_param(e.param)
        raise


_MESSAGE_200 = {
    200: {
        "description": "A Message; with `stream: true`, Server-Sent Events named by their type"
        " (message_start ... message_stop).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA},
        },
    }
}


@router.post("/v1/messages", response_model=None, responses=_MESSAGE_200)
async def create_message(
    body: MessagesRequest,
    request: Request,
    serving: AdmittedServing,
    record: Record,
    beta: Beta = None,
) -> Response:
    settings = serving.settings
    user = body.metadata.user_id if body.metadata else None
    serving.check_tenant_before_prepare(record, user)  # a 429 costs no templating
    asked = diagnostics_asked(serving, body, record)
    with named_as_messages():
        strip = settings.strip_volatile_system_lines
        max_output_tokens = serving.limits.max_output_tokens
        chat_request = body.to_chat_request(strip, max_output_tokens, asked.previous_chat_id)
        volatile = None if strip or not body.has_volatile_system_line() else VOLATILE_SYSTEM_LINE
        prepared = await serving.prepare(chat_request, record, volatile_line=volatile)
        serving.check_tenant_limits(prepared, record)
    message_id = message_id_of(prepared)
    if body.stream:
        stream = MessageStream(serving, prepared, record, message_id, asked)
        return message_stream(stream, settings.keepalive_seconds, get_state(request).is_grace_over)
    try:
        work = run_message(serving, prepared, record, message_id, asked)
        message = await cancel_on_disconnect(request.receive, work)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(message)


def diagnostics_asked(
    serving: OpenAIServing, body: MessagesRequest, record: RequestRecord
) -> DiagnosticsAsked:
    """What diagnostics the Message carries; a previous_message_id this tenant still has
    becomes the comparison (one it does not: previous_message_not_found, not a 404)."""
    previous_missing, previous_chat_id = False, None
    previous = body.diagnostics.previous_message_id if body.diagnostics else None
    if previous is not None and not isinstance(body.cache_diagnostics, CacheDiagnosticsOptions):
        try:
            scope = diagnostics_scope(record.tenant, body.cache_salt)
            serving.recent_prompts.lookup(scope, chat_id_of(previous))
            previous_chat_id = chat_id_of(previous)
        except APIError:
            previous_missing = True
    extension = wants_diagnostics(body.cache_diagnostics, serving.settings.cache_diagnostics)
    native = body.diagnostics is not None
    return DiagnosticsAsked(native, extension, previous_missing, previous_chat_id)


class CountTokensRequest(MessagesConversation):
    """POST /v1/messages/count_tokens: a Messages request without the sampling fields."""


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(
    body: CountTokensRequest, serving: ReadyServing, record: Record, beta: Beta = None
) -> dict[str, Any]:
    with named_as_messages(), serving.tenant_slot(record):
        return await anyio.to_thread.run_sync(count_tokens, serving, body)


def count_tokens(serving: OpenAIServing, body: MessagesConversation) -> dict[str, Any]:
    """{"input_tokens"}: the prompt as POST /v1/messages renders it (blocking: templating)."""
    chat_request = body.to_chat_request(serving.settings.strip_volatile_system_lines)
    chat_request.structured  # noqa: B018 (tool schemas, checked as served)
    return {"input_tokens": len(serving.preparer.chat_prompt(chat_request).token_ids)}
