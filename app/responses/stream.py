"""POST /v1/responses with `stream: true`: the chat pipeline's deltas as Responses events.

The order (the spec's ResponseStreamEvent members), numbered by `sequence_number` from 0:
  response.created, response.in_progress;
  the message item once there is final text: response.output_item.added,
  response.content_part.added, response.output_text.delta ...;
  when the choice ends: response.output_text.done, response.content_part.done,
  response.output_item.done; then per function call: response.output_item.added,
  response.function_call_arguments.delta, response.function_call_arguments.done,
  response.output_item.done;
  exactly one terminal event, always the last: response.completed, response.incomplete
  (max_output_tokens cut the answer) or response.failed (the engine failed, the server began
  draining, or anything else went wrong after the 200 was sent).

The terminal response is response_object() of the chat response that the non-streaming call
builds from the same deltas (formatter.response), so both agree. The text deltas are what the
tool-call parser releases as final while the choice runs, plus the rest when it ends, so they
concatenate to the final text by construction.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from starlette.responses import StreamingResponse

from app.errors import APIError
from app.openai.formatting import ChoiceDelta
from app.openai.response_models import ChatCompletionResponse
from app.responses.format import echoed_fields, response_object, usage_object
from app.responses.request import ResponsesRequest
from app.serving.records import Prepared, RequestRecord
from app.serving.service import OpenAIServing
from app.streaming import KEEPALIVE, SSE_HEADERS, SSEResponse, named_sse_events

logger = logging.getLogger(__name__)

_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}


def _error_code(error: APIError) -> str:
    """The spec's ResponseErrorCode closest to an HTTP status."""
    if error.status_code == 429:
        return "rate_limit_exceeded"
    return "server_error" if error.status_code >= 500 else "invalid_prompt"


class ResponseEvents:
    """One streamed response's events: numbered from 0, the message item opened on its first
    text, one terminal event at most (`is_ended` once it is out)."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, created: int):
        self.num_events = 0
        self.message_id = "msg_" + secrets.token_hex(12)
        self.streamed_text = ""
        self.is_message_open = False
        self.is_ended = False
        self.snapshot: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "completed_at": None,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "output": [],  # no usage yet: the spec's ResponseUsage is not nullable
            **echoed_fields(request, model),
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=dict(self.snapshot)),
            self._event("response.in_progress", response=dict(self.snapshot)),
        ]

    def text_delta(self, text: str) -> list[dict[str, Any]]:
        """The events of `text` (final content): the message item first if it is not open."""
        if not text:
            return []
        events = [] if self.is_message_open else self._open_message()
        self.streamed_text += text
        part = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        events.append(self._event("response.output_text.delta", **part, delta=text, logprobs=[]))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self.is_message_open = True
        item = {
            "type": "message",
            "id": self.message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **where, part=part),
        ]

    def finish(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The closing events of every output item of `final`, then its terminal event."""
        output = final["output"]
        has_message = bool(output) and output[0]["type"] == "message"
        if self.is_message_open and not has_message:
            raise RuntimeError("the streamed text has no message in the final response")
        events = []
        for index, item in enumerate(output):
            if item["type"] == "message":
                item["id"] = self.message_id
                events += self._close_message(item)
            else:
                events += self._function_call(index, item)
        self.is_ended = True
        events.append(self._event(_TERMINAL[final["status"]], response=final))
        return events

    def _close_message(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        part = item["content"][0]
        if not part["text"].startswith(self.streamed_text):
            raise RuntimeError("the streamed text is not a prefix of the final text")
        events = self.text_delta(part["text"][len(self.streamed_text) :])
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [
            *events,
            self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _function_call(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        opened = {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": index}
        arguments = item["arguments"]
        return [
            self._event("response.output_item.added", output_index=index, item=opened),
            self._event("response.function_call_arguments.delta", **where, delta=arguments),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def failed(self, error: APIError, usage: dict[str, Any] | None) -> dict[str, Any] | None:
        """The response.failed event (None once a terminal event is out): the text streamed
        so far as an incomplete message, the usage so far."""
        if self.is_ended:
            return None
        self.is_ended = True
        output = []
        if self.is_message_open:
            part = {"type": "output_text", "text": self.streamed_text}
            part |= {"annotations": [], "logprobs": []}
            message = {"type": "message", "id": self.message_id, "status": "incomplete"}
            output.append(message | {"role": "assistant", "content": [part]})
        error_object = {"code": _error_code(error), "message": error.message}
        response = self.snapshot | {"status": "failed", "error": error_object, "output": output}
        if usage is not None:
            response["usage"] = usage
        return self._event("response.failed", response=response)


# The final Response of a finished answer, from its chat response, its deltas and the id the
# stream gave its message item (what a store keeps is made here; the default is
# response_object()).
FinishResponse = Callable[
    [ChatCompletionResponse, list[ChoiceDelta], str], Awaitable[dict[str, Any]]
]


class ResponseStream:
    """One prepared Responses request, run through serving.run() and told as events."""

    def __init__(
        self,
        serving: OpenAIServing,
        prepared: Prepared,
        record: RequestRecord,
        request: ResponsesRequest,
        finish: FinishResponse | None = None,
    ) -> None:
        self.serving = serving
        self.prepared = prepared
        self.record = record
        self.request = request
        self.finish = finish or self._response_object
        header = prepared.formatter.header
        response_id = "resp_" + header["id"].removeprefix("chatcmpl-")  # as response_object()
        self.events = ResponseEvents(request, response_id, header["model"], header["created"])

    async def run(self) -> AsyncIterator[dict[str, Any]]:
        """Every event but response.failed (failed() makes that one); errors propagate."""
        for event in self.events.opening():
            yield event
        deltas: list[ChoiceDelta] = []
        async with aclosing(self.serving.run_content(self.prepared, self.record)) as run:
            async for delta, content in run:
                deltas.append(delta)
                for event in self.events.text_delta(content):
                    yield event
        formatter = self.prepared.formatter
        chat = formatter.response(self.prepared.num_choices, deltas, self.record.usage())
        assert isinstance(chat, ChatCompletionResponse)
        final = await self.finish(chat, deltas, self.events.message_id)
        for event in self.events.finish(final):
            yield event

    async def _response_object(
        self, chat: ChatCompletionResponse, deltas: list[ChoiceDelta], message_id: str
    ) -> dict[str, Any]:
        return response_object(self.request, chat, message_id)

    def failed(self, error: APIError) -> dict[str, Any] | None:
        usage = usage_object(self.record.usage()) if self.record.prompt_tokens else None
        return self.events.failed(error, usage)


def response_stream(
    stream: ResponseStream, keepalive_seconds: float, stop: asyncio.Event | None = None
) -> StreamingResponse:
    """The SSE response (the terminal event ends it); a client that disconnects closes it,
    which aborts the request."""
    events = named_sse_events(
        stream.run(), keepalive_seconds, stop, idle=lambda: KEEPALIVE, failed=stream.failed
    )
    return SSEResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
