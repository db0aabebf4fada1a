"""Anthropic's Message, whole or as its event stream, from the chat pipeline's deltas.

The stream's order: message_start (once the prompt was admitted, so its usage says what the
cache served), then per content block content_block_start, content_block_delta ...,
content_block_stop (a `ping` after the first block opens, and as the keep-alive), then
message_delta (stop_reason, the whole usage) and message_stop; an `error` event instead of
whatever is left when the request fails after the 200. The text deltas are what the tool-call
parser releases as final while the answer runs; tool_use blocks open when it ends, from the
chat response the non-streamed call builds from the same deltas, so both agree.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.responses import StreamingResponse

from app.errors import SERVER_ERROR, APIError
from app.formatting import ChoiceDelta
from app.response_models import ChatCompletionResponse
from app.serving import OpenAIServing, Prepared, RequestRecord
from app.streaming import KEEPALIVE, SSE_HEADERS, SSEResponse, sse_event, with_keepalive
from app.tool_calls import ToolCallParser

logger = logging.getLogger(__name__)

PING = {"type": "ping"}


def usage(record: RequestRecord) -> dict[str, int]:
    """What the prefix cache served (cache_read), what this request added to it
    (cache_creation) and the rest of the prompt (input): the three sum to the prompt."""
    read = record.cached_tokens
    created = min(record.stored_prompt_tokens, record.prompt_tokens - read)
    return {
        "input_tokens": record.prompt_tokens - read - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "output_tokens": record.completion_tokens,
    }


def stop_reason(finish_reason: str | None, stop_string: str | None, has_calls: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if has_calls:
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def content_blocks(chat: ChatCompletionResponse) -> list[dict[str, Any]]:
    """The answer's text block (none if empty), then a tool_use block per complete call
    (a call cut by max_tokens has no input to give)."""
    message = chat.choices[0].message
    blocks: list[dict[str, Any]] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            continue
        if isinstance(arguments, dict):
            tool_id = "toolu_" + call.id.removeprefix("call_")
            blocks.append(
                {"type": "tool_use", "id": tool_id, "name": call.function.name, "input": arguments}
            )
    return blocks


def message_object(
    message_id: str,
    model: str,
    chat: ChatCompletionResponse,
    stop_string: str | None,
    record: RequestRecord,
) -> dict[str, Any]:
    blocks = content_blocks(chat)
    has_calls = any(block["type"] == "tool_use" for block in blocks)
    reason = stop_reason(chat.choices[0].finish_reason, stop_string, has_calls)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop_string if reason == "stop_sequence" else None,
        "usage": usage(record),
    }


def message_id_of(prepared: Prepared) -> str:
    """The Message's id: its chat response's, so cache_diagnostics.compare_to finds it."""
    return "msg_" + prepared.formatter.header["id"].removeprefix("chatcmpl-")


async def run_message(
    serving: OpenAIServing, prepared: Prepared, record: RequestRecord, message_id: str
) -> dict[str, Any]:
    """The whole Message (non-streaming); cache_diagnostics beside it when asked for."""
    deltas = [delta async for delta in serving.run(prepared, record)]
    message = _final(prepared, record, message_id, deltas)
    diagnostics = serving.diagnostics_json(prepared, record)
    return message if diagnostics is None else {**message, "cache_diagnostics": diagnostics}


def _final(
    prepared: Prepared, record: RequestRecord, message_id: str, deltas: list[ChoiceDelta]
) -> dict[str, Any]:
    formatter = prepared.formatter
    chat = formatter.response(prepared.num_choices, deltas, record.usage())
    assert isinstance(chat, ChatCompletionResponse)
    stop_string = next((d.stop_string for d in deltas if d.stop_string is not None), None)
    return message_object(message_id, formatter.header["model"], chat, stop_string, record)


class MessageStream:
    """One prepared Messages request, run through serving.run() and told as events."""

    def __init__(
        self, serving: OpenAIServing, prepared: Prepared, record: RequestRecord, message_id: str
    ) -> None:
        self.serving = serving
        self.prepared = prepared
        self.record = record
        self.message_id = message_id
        self.num_blocks = 0  # content blocks opened so far
        self.is_text_open = False
        self.streamed_text = ""
        self.has_started = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event but `error` (the caller makes that one); errors propagate."""
        mode = getattr(self.prepared.formatter, "tool_call_mode", None)
        parser = None if mode is None else ToolCallParser(mode)
        deltas: list[ChoiceDelta] = []
        async with aclosing(self.serving.run(self.prepared, self.record)) as run:
            async for delta in run:
                deltas.append(delta)
                for event in self._start():
                    yield event
                text = delta.text if parser is None else parser.feed(delta.text)
                for event in self._text(text):
                    yield event
        for event in self._start():  # a prompt-only answer still starts
            yield event
        final = _final(self.prepared, self.record, self.message_id, deltas)
        for event in self._finish(final):
            yield event

    def _start(self) -> list[dict[str, Any]]:
        if self.has_started:
            return []
        self.has_started = True
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.prepared.formatter.header["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self.record),
        }
        return [{"type": "message_start", "message": message}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = [{"type": "content_block_start", "index": self.num_blocks, "content_block": block}]
        self.num_blocks += 1
        return events + ([PING] if self.num_blocks == 1 else [])

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.streamed_text += text
        events = []
        if not self.is_text_open:
            self.is_text_open = True
            events += self._open({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": 0, "delta": delta}]

    def _finish(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for block in final["content"]:
            if block["type"] == "text":
                if not block["text"].startswith(self.streamed_text):
                    raise RuntimeError("the streamed text is not a prefix of the final text")
                events += self._text(block["text"][len(self.streamed_text) :])  # held back
                events.append({"type": "content_block_stop", "index": 0})
            else:
                events += self._tool_use(block)
        if self.num_blocks == 0:
            events.append(PING)
        delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
        events.append({"type": "message_delta", "delta": delta, "usage": final["usage"]})
        events.append({"type": "message_stop"})
        return events

    def _tool_use(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        index = self.num_blocks
        opened = {**block, "input": {}}
        partial = json.dumps(block["input"], ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": partial}
        return [
            *self._open(opened),
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]


async def _sse(
    stream: MessageStream, keepalive_seconds: float, stop: asyncio.Event | None
) -> AsyncIterator[bytes]:
    """The events as named SSE events; idle, a comment before message_start and a ping
    after it; a failure after the 200 as one `error` event, which ends the stream."""
    try:
        events = with_keepalive(stream.events(), keepalive_seconds, stop)
        async with aclosing(events) as items:
            async for event in items:
                if event is None:
                    yield sse_event(PING, "ping") if stream.has_started else KEEPALIVE
                else:
                    yield sse_event(event, event["type"])
        return
    except APIError as e:  # the engine failed it, or the drain's grace ended
        error = e
    except Exception:
        logger.exception("message stream failed")
        error = APIError(500, "Internal server error", type=SERVER_ERROR)
    yield sse_event(error.anthropic_body(), "error")


def message_stream(
    stream: MessageStream, keepalive_seconds: float, stop: asyncio.Event | None = None
) -> StreamingResponse:
    """The SSE response; a client that disconnects closes it, which aborts the request."""
    events = _sse(stream, keepalive_seconds, stop)
    return SSEResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
