"""A chain of stored responses (previous_response_id): its items, and its prompt's tokens.

A continuation's conversation is everything the previous response was generated from, its
output, then the new input (the previous `instructions` are not carried over). Its prompt
starts with exactly the token ids the previous turn ran on and generated (chained_prompt), so
the radix tree matches the previous turn's blocks: re-tokenizing the rendered text could
split the generated answer into other tokens than the model produced.
"""

from __future__ import annotations

import secrets
from typing import Any

from engine.tokenizer import Tokenizer

_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def item_resources(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as the spec's item resources (each with an id), as stored and
    listed by GET /v1/responses/{id}/input_items. `given` was validated (input_messages)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    return [_resource(item) for item in given]


def _resource(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    item_id = item.get("id") or _ID_PREFIXES[kind] + secrets.token_hex(12)
    if kind == "function_call":
        fields = {k: item[k] for k in ("call_id", "name", "arguments")}
        return {"id": item_id, "type": kind, **fields, "status": "completed"}
    if kind == "function_call_output":
        output = item["output"]
        text = output if isinstance(output, str) else "".join(p["text"] for p in output)
        fields = {"call_id": item["call_id"], "output": text}
        return {"id": item_id, "type": kind, **fields, "status": "completed"}
    return _message_resource(item, item_id)


def _message_resource(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    content = item["content"]
    text = content if isinstance(content, str) else "".join(p["text"] for p in content)
    role = item["role"]
    if role == "assistant":  # the spec's OutputMessage
        part = {"type": "output_text", "text": text, "annotations": []}
    else:  # InputMessageResource
        part = {"type": "input_text", "text": text}
    return {
        "id": item_id,
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [part],
    }


def chained_prompt(tokenizer: Tokenizer, text: str, prefix_token_ids: list[int]) -> list[int]:
    """The prompt ids of rendered `text`: `prefix_token_ids` (the previous turn's prompt and
    output) then the rest of the text tokenized, when the text starts with what those ids
    decode to; otherwise the whole text tokenized (the template rewrote history, or the
    instructions or tools changed: the previous turn's blocks cannot match anyway)."""
    # The last generated token (often an EOS the template writes otherwise) never had its
    # KV computed: without it, the prefix matches as many cached blocks.
    for prefix in (prefix_token_ids, prefix_token_ids[:-1]):
        prefix_text = tokenizer.decode(prefix, skip_special_tokens=False)
        if prefix and text.startswith(prefix_text):
            rest = text[len(prefix_text) :]
            return list(prefix) + (tokenizer.encode(rest, False) if rest else [])
    return tokenizer.encode(text, False)
