"""Is the chat template append-only? Checked once at start (torch-free, text only).

A multi-turn chat shares its history with the prefix cache only if the template renders each
turn as an extension of the previous one. This renders a short synthetic conversation turn by
turn and checks that each turn's prompt starts with the previous turn's prompt plus its answer
as generated (what the prefix cache holds after that turn). A template that strips reasoning
from earlier answers, moves the tools or re-dates the system prompt fails, and the index of
the first message whose rendering changed is reported (the log at start, a gauge, and the
diagnostics of requests with history: reason template_rewrites_history).
"""

from __future__ import annotations

import logging
from typing import Any

from app.metrics import ServerMetrics
from engine.tokenizer import ChatTemplateError, Tokenizer

logger = logging.getLogger(__name__)

_ANSWERS = ("<think>Let me see.</think>It is four.", "<think>Easy.</think>Paris.")
_QUESTIONS = ("What is two plus two?", "And the capital of France?", "Thanks!")


def _conversation(num_turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for turn in range(num_turns):
        messages.append({"role": "user", "content": _QUESTIONS[turn]})
        if turn < num_turns - 1:
            messages.append({"role": "assistant", "content": _ANSWERS[turn]})
    return messages


def first_rewritten_message(tokenizer: Tokenizer) -> int | None:
    """The index of the first message an append-only template would have kept but this one
    re-renders differently in a later turn; None when the template is append-only (or refuses
    the synthetic conversation: nothing can be said then)."""
    try:
        for num_turns in range(1, len(_QUESTIONS)):
            # What the cache holds after a turn: its prompt and the answer as generated.
            cached = tokenizer.render_chat(_conversation(num_turns)) + _ANSWERS[num_turns - 1]
            later_messages = _conversation(num_turns + 1)
            later = tokenizer.render_chat(later_messages)
            if not later.startswith(cached):
                return _message_at(tokenizer, later_messages, _first_difference(cached, later))
    except ChatTemplateError:
        return None
    return None


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def _message_at(tokenizer: Tokenizer, messages: list[dict[str, Any]], offset: int) -> int:
    """The message whose rendering holds character `offset` of the rendered conversation."""
    for index in range(len(messages)):
        end = len(tokenizer.render_chat(messages[: index + 1], add_generation_prompt=False))
        if offset < end:
            return index
    return len(messages) - 1


def check_chat_template(tokenizer: Tokenizer, metrics: ServerMetrics) -> int | None:
    """first_rewritten_message, logged and set as the gauge; run once at start."""
    index = first_rewritten_message(tokenizer)
    metrics.chat_template_append_only.set(1 if index is None else 0)
    if index is not None:
        logger.warning(
            "the chat template is not append-only: a later turn re-renders message %d of the "
            "history differently, so multi-turn chats miss the prefix cache from there "
            "(docs/cache-diagnostics.md, reason template_rewrites_history)",
            index,
        )
    return index
