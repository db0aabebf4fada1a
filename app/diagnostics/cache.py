"""Why a prompt missed the prefix cache, as the response tells it (docs/cache-diagnostics.md).

The engine decides the reason and the first unmatched token (engine/kv/cache_diagnosis.py);
this module places that token in the request: which segment of the chat it falls in (from
the template's own rendering offsets: each message's end is where the rendering of the
conversation up to it ends) and a few tokens of this request's own text around it. Nothing
here ever reads another request's text. `compare_to` looks up an earlier prompt of the same
tenant in RecentPrompts, a bounded map of recent response ids to their prompt token ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.errors import APIError
from engine.core.protocol import CacheDiagnosis
from engine.tokenizer import ChatTemplateError, Tokenizer

NUM_CONTEXT_TOKENS = 8  # tokens of this request's text shown on each side of the miss


@dataclass(frozen=True)
class Segment:
    """The part of a prompt that starts at token `start`."""

    start: int
    kind: str  # system | tools | message | generation_prompt | prompt
    message_index: int | None = None
    role: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.message_index is not None:
            out["message_index"] = self.message_index
            out["role"] = self.role
        return out


def chat_segments(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[Segment]:
    """Message i starts where the rendering of messages[:i] ends; the closing generation
    prompt starts after the last message; with tools, the tool definitions are a segment of
    their own inside the message the template renders them into (tools_span). Renders about
    len(messages) prefixes: diagnosed requests only."""
    segments = _message_segments(tokenizer, messages, tools)
    span = tools_span(tokenizer, messages, tools) if tools else None
    return segments if span is None else _with_tools(segments, *span)


def _message_segments(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[Segment]:
    """A prefix the template refuses ends the list there (its tokens count as the last)."""
    segments: list[Segment] = []
    start = 0
    for index, message in enumerate(messages):
        role = str(message.get("role"))
        kind = "system" if role == "system" else "message"
        segments.append(Segment(start, kind, index, role))
        try:
            start = len(tokenizer.apply_chat_template(messages[: index + 1], False, tools=tools))
        except ChatTemplateError:
            return segments
    segments.append(Segment(start, "generation_prompt"))
    return segments


def tools_span(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
) -> tuple[int, int] | None:
    """Token offsets [start, end) of the rendered tool definitions, found from the template
    itself: the shortest prefix of the messages whose rendering with the tools differs from
    its rendering without them; the span is where the two part and where they agree again.
    None when no prefix shows the tools (or the template refuses every one)."""
    for num_messages in range(1, len(messages) + 1):
        head = messages[:num_messages]
        try:
            with_tools = tokenizer.render_chat(head, False, tools=tools)
            without = tokenizer.render_chat(head, False)
        except ChatTemplateError:
            continue  # e.g. a tool message the template takes only beside tools
        if with_tools != without:
            start, end = changed_span(without, with_tools)
            encode = tokenizer.encode
            return len(encode(with_tools[:start], False)), len(encode(with_tools[:end], False))
    return None


def changed_span(before: str, after: str) -> tuple[int, int]:
    """[start, end) of `after` that replaces part of `before`: before the longest common
    suffix, after the longest common prefix that does not overlap it (suffix first, so an
    inserted block, such as a system message that lists the tools, is the span whole)."""
    num_suffix = _num_common_leading(before[::-1], after[::-1])
    room = min(len(before), len(after)) - num_suffix
    return min(_num_common_leading(before, after), room), len(after) - num_suffix


def _num_common_leading(a: str, b: str) -> int:
    different = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(different, min(len(a), len(b)))


def _with_tools(segments: list[Segment], start: int, end: int) -> list[Segment]:
    """The tools segment at [start, end); the segment it interrupts resumes at end."""
    if start >= end:
        return segments
    kept = [segment for segment in segments if not start <= segment.start < end]
    added = [Segment(start, "tools")]
    if all(segment.start != end for segment in segments):
        added.append(replace(segment_at(segments, end), start=end))
    return sorted(kept + added, key=lambda segment: segment.start)


def segment_at(segments: Sequence[Segment], index: int) -> Segment:
    found = segments[0]
    for segment in segments:
        if segment.start > index:
            break
        found = segment
    return found


@dataclass
class DiagnosticsContext:
    """What a diagnosed request keeps to explain its answer: its own prompt and segments."""

    prompt_token_ids: list[int]
    segments: list[Segment]
    compared_token_ids: list[int] | None = None  # the compare_to prompt
    compare_to: str | None = None
    template_rewrites_history: bool = False  # the chat template is not append-only

    def _history_rewrite(self, segment: Segment) -> int | None:
        """The first assistant message of this request, if the miss lies at or after it and
        the template rewrites history; else None."""
        if not self.template_rewrites_history or segment.message_index is None:
            return None
        answers = [s.message_index for s in self.segments if s.role == "assistant"]
        if answers and segment.message_index >= answers[0]:
            return answers[0]
        return None

    def point(self, tokenizer: Tokenizer, index: int | None) -> dict[str, Any]:
        """Where token `index` of this prompt lies, with this prompt's text around it."""
        if index is None:
            return {}
        ids = self.prompt_token_ids
        return {
            "segment": segment_at(self.segments, index).to_json(),
            "text_before": tokenizer.decode(ids[max(0, index - NUM_CONTEXT_TOKENS) : index]),
            "text_at": tokenizer.decode(ids[index : index + NUM_CONTEXT_TOKENS]),
        }

    def to_json(
        self, diagnosis: CacheDiagnosis | None, tokenizer: Tokenizer, has_tenants: bool
    ) -> dict[str, Any]:
        """The response's cache_diagnostics. With tenants (API keys), `other_namespace` is
        answered as `no_earlier_prefix`: whether another tenant holds a prompt is that
        tenant's secret (the metric still counts the true reason, for the operator)."""
        if diagnosis is None:  # the engine gave none (a fake engine, an early error)
            out = {"prompt_tokens": len(self.prompt_token_ids), "reason": None}
            if self.compared_token_ids is not None:
                out["compare_to"] = self._comparison(tokenizer)
            return out
        reason = diagnosis.reason
        if has_tenants and reason == "other_namespace":
            reason = "no_earlier_prefix"
        out: dict[str, Any] = {
            "prompt_tokens": diagnosis.num_prompt_tokens,
            "matched_tokens": diagnosis.num_matched_tokens,
            "block_size": diagnosis.block_size,
            "first_miss_index": diagnosis.first_miss_index,
            "reason": reason,
            **self.point(tokenizer, diagnosis.first_miss_index),
        }
        if diagnosis.first_miss_index is not None and reason == "diverged":
            rewritten = self._history_rewrite(segment_at(self.segments, diagnosis.first_miss_index))
            if rewritten is not None:
                out["reason"] = "template_rewrites_history"
                out["rewritten_message_index"] = rewritten
        if self.compared_token_ids is not None:
            out["compare_to"] = self._comparison(tokenizer)
        return out

    def _comparison(self, tokenizer: Tokenizer) -> dict[str, Any]:
        first_difference = first_difference_index(self.prompt_token_ids, self.compared_token_ids)
        return {
            "id": self.compare_to,
            "first_difference_index": first_difference,
            **self.point(tokenizer, first_difference),
        }


def first_difference_index(ids: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where the two differ (the shorter one's length if one is a prefix
    of the other); None when they are equal."""
    for index, (a, b) in enumerate(zip(ids, other, strict=False)):
        if a != b:
            return index
    return None if len(ids) == len(other) else min(len(ids), len(other))


@dataclass(frozen=True)
class RecentPrompt:
    """One remembered prompt: its token ids and, for chat, what renders its segments."""

    token_ids: list[int]
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None

    def segments(self, tokenizer: Tokenizer) -> list[Segment]:
        if self.messages is None:
            return [Segment(0, "prompt")]
        return chat_segments(tokenizer, self.messages, self.tools)


# Whose prompts a request's diagnostics see: (tenant, cache_salt), as its cache namespace.
Scope = tuple[str | None, str | None]


class RecentPrompts:
    """The prompts of each tenant's most recent responses, by response id, each with the
    cache_salt it came with: a scope (tenant, salt) sees only its own.

    Bounded: at most `num_per_tenant` ids per tenant, whatever their salts (so no tenant's
    salts push another tenant out), and `num_tenants` tenants (least recently used dropped
    first); num_per_tenant 0 keeps nothing (compare_to and the cache report are then off).
    Holds references to what the requests built anyway.
    """

    def __init__(self, num_per_tenant: int = 256, num_tenants: int = 64) -> None:
        self.num_per_tenant = num_per_tenant
        self.num_tenants = num_tenants
        self._by_tenant: OrderedDict[str, OrderedDict[str, tuple[str | None, RecentPrompt]]]
        self._by_tenant = OrderedDict()

    def remember(self, scope: Scope, response_id: str, prompt: RecentPrompt) -> None:
        if self.num_per_tenant <= 0:
            return
        tenant, salt = scope[0] or "", scope[1]
        recent = self._by_tenant.setdefault(tenant, OrderedDict())
        self._by_tenant.move_to_end(tenant)
        recent[response_id] = (salt, prompt)
        while len(recent) > self.num_per_tenant:
            recent.popitem(last=False)
        while len(self._by_tenant) > self.num_tenants:
            self._by_tenant.popitem(last=False)

    def prompts_of(self, scope: Scope) -> list[RecentPrompt]:
        """The scope's remembered prompts, oldest first."""
        recent = self._by_tenant.get(scope[0] or "", {})
        return [prompt for salt, prompt in recent.values() if salt == scope[1]]

    def lookup(self, scope: Scope, response_id: str) -> list[int]:
        """The earlier prompt's token ids; a 404 for an id this scope never had (or that was
        dropped), the same answer whether or not another tenant or salt has it."""
        salt, found = self._by_tenant.get(scope[0] or "", {}).get(response_id, (None, None))
        if found is None or salt != scope[1]:
            raise APIError(
                404,
                f"No recent completion `{response_id}` to compare with.",
                param="cache_diagnostics.compare_to",
                code="not_found",
            )
        return found.token_ids


def wants_diagnostics(option: bool | Any | None, server_wide: bool) -> bool:
    return server_wide or bool(option)


def make_context(
    option: bool | Any | None,
    recent: RecentPrompts,
    scope: Scope,
    prompt_token_ids: list[int],
    segments: list[Segment],
) -> DiagnosticsContext:
    """The context of a diagnosed request; resolves compare_to (404 when unknown)."""
    compare_to = getattr(option, "compare_to", None)
    compared = None if compare_to is None else recent.lookup(scope, compare_to)
    return DiagnosticsContext(prompt_token_ids, segments, compared, compare_to)
