"""The Response object (the spec's `Response`) made from the chat response that served it."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from app.openai.response_models import ChatCompletionResponse, Usage
from app.responses.request import ResponsesRequest


def response_object(
    request: ResponsesRequest, chat: ChatCompletionResponse, message_id: str | None = None
) -> dict[str, Any]:
    """The Response for one chat choice: status, output items, echoed fields and usage;
    message_id: the message item's id (a streamed one's, sent before the answer ended)."""
    choice = chat.choices[0]
    incomplete = choice.finish_reason == "length"
    return {
        "id": "resp_" + chat.id.removeprefix("chatcmpl-"),
        "object": "response",
        "created_at": chat.created,
        "completed_at": None if incomplete else int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output_items(
            choice.message.content, choice.message.tool_calls or [], message_id, incomplete
        ),
        "usage": usage_object(chat.usage),
        **echoed_fields(request, chat.model),
    }


def echoed_fields(request: ResponsesRequest, model: str) -> dict[str, Any]:
    tools = [tool.model_dump() for tool in request.function_tools() or []]
    choice = request.tool_choice
    return {
        "model": model,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": None,
        "store": request.is_stored,  # the route says false if the store could not keep it
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "text": {"format": (request.text and request.text.format) or {"type": "text"}},
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto",
        "tools": tools,
        "truncation": "disabled",
        "background": False,
    } | ({} if request.user is None else {"user": request.user})


def output_items(
    text: str | None,
    tool_calls: list[Any],
    message_id: str | None = None,
    is_cut: bool = False,
) -> list[dict[str, Any]]:
    """The output items of a chat message; `is_cut` (max_output_tokens ended it) makes the
    message incomplete, and the call whose arguments were cut."""
    items: list[dict[str, Any]] = []
    if text:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        items.append(
            {
                "type": "message",
                "id": message_id or "msg_" + secrets.token_hex(12),
                "status": "incomplete" if is_cut else "completed",
                "role": "assistant",
                "content": content,
            }
        )
    for call in tool_calls:
        is_call_cut = is_cut and not _is_json(call.function.arguments)
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + secrets.token_hex(12),
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "incomplete" if is_call_cut else "completed",
            }
        )
    return items


def _is_json(text: str) -> bool:
    """Whether `text` is whole JSON: a cut call's arguments are not (app/openai/tool_calls.py)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def usage_object(usage: Usage) -> dict[str, Any]:
    """The Responses usage (ResponseUsage) of a chat usage."""
    cached = usage.prompt_tokens_details.cached_tokens
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": usage.prompt_tokens - cached,  # computed, then cached
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }
