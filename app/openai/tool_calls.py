"""Tool calls in a chat choice's text: the modes that hold them and the parser that finds them,
cut ones included (max_tokens or a stop string can end a forced call anywhere)."""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any


class ToolCallMode(enum.Enum):
    """How a chat choice's text holds tool calls: AUTO, text with `<tool_call>` blocks
    (tool_choice "auto"); FORCED, nothing but the calls' JSON ("required" or a named one)."""

    AUTO = "auto"
    FORCED = "forced"

    @classmethod
    def of(cls, tool_mode: str | None) -> ToolCallMode | None:
        """None (no parsing) without tools or with tool_choice "none"."""
        if tool_mode in (None, "none"):
            return None
        return cls.AUTO if tool_mode == "auto" else cls.FORCED


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object; a cut call's: the text written so far
    is_complete: bool = True  # False: the output ended before its arguments were whole


TOOL_CALL_BEGIN = "<tool_call>"
_TOOL_CALL_END = "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# The start of a cut call object: its whole name, then maybe the "arguments" key.
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")(?P<key>\s*,\s*"arguments"\s*:\s*)?'
)
_SEPARATORS = (" ", "\t", "\n", "\r", ",")  # between array elements
_DECODER = json.JSONDecoder()


class ToolCallParser:
    """One choice's text -> its content and its tool calls, fed as it streams.

    feed() returns the content that is final: in AUTO mode the text before the first
    `<tool_call>` (trailing whitespace and a possible start of the tag are held back); in
    FORCED mode nothing. finish() returns the rest of the content and the calls. The
    non-streamed response feeds the whole text once, so both agree by construction.
    AUTO: a block the output cut is a call as in FORCED; a closed block that does not parse
    as a call (the grammar allows none) comes back as content. FORCED: the text is never
    content; a cut output gives the whole calls and the cut one (is_complete False) once its
    name is written.
    """

    def __init__(self, mode: ToolCallMode) -> None:
        self.mode = mode
        self._held = ""
        self._in_calls = mode is ToolCallMode.FORCED
        self._emitted = False

    def feed(self, text: str) -> str:
        self._held += text
        if self._in_calls:
            return ""
        start = self._held.find(TOOL_CALL_BEGIN)
        if start >= 0:
            self._in_calls = True
            content, self._held = self._held[:start].rstrip(), self._held[start:]
        else:
            cut = len(self._held[: len(self._held) - _partial_tag_length(self._held)].rstrip())
            content, self._held = self._held[:cut], self._held[cut:]
        self._emitted = self._emitted or bool(content)
        return content

    def finish(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        if self.mode is ToolCallMode.FORCED:
            return "", forced_calls(held)
        calls: list[ParsedCall] = []
        end = 0
        for match in _TOOL_CALL_BLOCK.finditer(held):
            call = _call_of(match.group(1))
            if call is None:
                break
            calls.append(call)
            end = match.end()
        tail = held[end:].strip()
        if tail.startswith(TOOL_CALL_BEGIN) and _TOOL_CALL_END not in tail:
            # cut by the output's end (the grammar closes every other): a call, not content
            cut = _cut_call(tail.removeprefix(TOOL_CALL_BEGIN).strip())
            return "", calls if cut is None else [*calls, cut]
        rest = held[end:] if not calls else tail
        if rest and calls and self._emitted:
            rest = "\n" + rest
        return rest, calls


def _partial_tag_length(text: str) -> int:
    """Length of the longest end of `text` that could grow into TOOL_CALL_BEGIN."""
    for length in range(min(len(text), len(TOOL_CALL_BEGIN) - 1), 0, -1):
        if text.endswith(TOOL_CALL_BEGIN[:length]):
            return length
    return 0


def _call_of(value: Any) -> ParsedCall | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get("arguments")
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def forced_calls(text: str) -> list[ParsedCall]:
    """The calls of a FORCED output, `{"name": ..., "arguments": {...}}` or an array of such
    objects, whole or cut: the whole calls in order, then the cut one if its name is written."""
    text = text.strip()
    is_array = text.startswith("[")
    position = 1 if is_array else 0
    calls: list[ParsedCall] = []
    while True:
        while is_array and text[position : position + 1] in _SEPARATORS:
            position += 1
        try:
            value, position = _DECODER.raw_decode(text, position)
        except ValueError:  # the cut element, or the array's closing bracket
            cut = _cut_call(text[position:])
            return calls if cut is None else [*calls, cut]
        call = _call_of(value)
        if call is None:
            return calls
        calls.append(call)
        if not is_array:
            return calls


def _cut_call(text: str) -> ParsedCall | None:
    """The call in a cut object: None before its name is whole; whole arguments (only its
    closing brace cut) make a complete call, others are the text written so far."""
    head = _CALL_HEAD.match(text)
    if head is None:
        return None
    name = json.loads(head.group("name"))
    arguments = text[head.end() :] if head.group("key") else ""
    try:
        value, _ = _DECODER.raw_decode(arguments)
    except ValueError:
        return ParsedCall(name, arguments, is_complete=False)
    return _call_of({"name": name, "arguments": value})
