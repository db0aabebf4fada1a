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
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse

from app.errors import APIError
from app.openai.formatting import ChoiceDelta
from app.openai.response_models import ChatCompletionResponse
from app.serving.records import Prepared, RequestRecord
from app.serving.service import OpenAIServing
from app.streaming import KEEPALIVE, SSE_HEADERS, SSEResponse, named_sse_events, sse_event

logger = logging.getLogger(__name__)

PING = {"type": "ping"}
# The segment of the first token that differs from the previous prompt -> Anthropic's reason.
_CHANGED = {"system": "system_changed", "tools": "tools_changed"}


@dataclass(frozen=True)
class DiagnosticsAsked:
    """What a Message carries of the cache diagnostics: Anthropic's `diagnostics` (native),
    kvshare's `cache_diagnostics` (extension); previous_missing: the previous Message named
    is not one this tenant still has."""

    native: bool = False
    extension: bool = False
    previous_missing: bool = False
    previous_chat_id: str | None = None  # the comparison, where the previous Message is known

    def fields(self, ours: dict[str, Any] | None, prepared: Prepared) -> dict[str, Any]:
        """The Message's diagnostics fields from `ours` (serving.diagnostics_json)."""
        out: dict[str, Any] = {}
        if self.extension and ours is not None:
            out["cache_diagnostics"] = ours
        if self.native:
            out["diagnostics"] = self._native(ours, prepared)
        return out

    def _native(self, ours: dict[str, Any] | None, prepared: Prepared) -> dict[str, Any] | None:
        """Why this prompt could not reuse the previous one: where it first differs and how
        many of the previous prompt's tokens lie past that (null: it only appends)."""
        if self.previous_missing:
            return {"cache_miss_reason": {"type": "previous_message_not_found"}}
        compare = (ours or {}).get("compare_to")
        context = prepared.diagnostics
        if compare is None or context is None or context.compared_token_ids is None:
            return None
        num_previous = len(context.compared_token_ids)
        first = compare["first_difference_index"]
        if first is None or first >= num_previous:
            return None
        kind = _CHANGED.get(compare["segment"]["kind"], "messages_changed")
        missed = num_previous - first
        return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": missed}}


def usage(record: RequestRecord) -> dict[str, int]:
    """What the prefix cache served (cache_read), what this request added to it
    (cache_creation) and the rest of the prompt (input): the three sum to the prompt."""
    read, created = record.cached_tokens, record.stored_prompt_tokens
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
    serving: OpenAIServing,
    prepared: Prepared,
    record: RequestRecord,
    message_id: str,
    asked: DiagnosticsAsked,
) -> dict[str, Any]:
    """The whole Message (non-streaming), with the diagnostics asked for."""
    deltas = [delta async for delta in serving.run(prepared, record)]
    message = _final(prepared, record, message_id, deltas)
    return message | asked.fields(serving.diagnostics_json(prepared, record), prepared)


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
        self,
        serving: OpenAIServing,
        prepared: Prepared,
        record: RequestRecord,
        message_id: str,
        asked: DiagnosticsAsked,
    ) -> None:
        self.serving = serving
        self.prepared = prepared
        self.record = record
        self.message_id = message_id
        self.asked = asked
        self.diagnostics: dict[str, Any] = {}  # made at message_start, once the cache answered
        self.num_blocks = 0  # content blocks opened so far
        self.is_text_open = False
        self.streamed_text = ""
        self.has_started = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event but `error` (the caller makes that one); errors propagate."""
        deltas: list[ChoiceDelta] = []
        async with aclosing(self.serving.run_content(self.prepared, self.record)) as run:
            async for delta, content in run:
                deltas.append(delta)
                for event in self._start():
                    yield event
                for event in self._text(content):
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
        ours = self.serving.diagnostics_json(self.prepared, self.record)
        self.diagnostics = self.asked.fields(ours, self.prepared)
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
        if "diagnostics" in self.diagnostics:
            message["diagnostics"] = self.diagnostics["diagnostics"]
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
        message_delta = {"type": "message_delta", "delta": delta, "usage": final["usage"]}
        if "cache_diagnostics" in self.diagnostics:  # kvshare's extension, beside the usage
            message_delta["cache_diagnostics"] = self.diagnostics["cache_diagnostics"]
        events.append(message_delta)
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


def message_stream(
    stream: MessageStream, keepalive_seconds: float, stop: asyncio.Event | None = None
) -> StreamingResponse:
    """The SSE response: idle, a comment before message_start and a ping after it; a failure
    after the 200 as one `error` event. A client that disconnects closes it, which aborts
    the request."""

    def idle() -> bytes:
        return sse_event(PING, "ping") if stream.has_started else KEEPALIVE

    events = named_sse_events(
        stream.events(), keepalive_seconds, stop, idle, APIError.anthropic_body
    )
    return SSEResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
