"""The tool-call parser: FORCED outputs whole and cut at every kind of point (the cut call keeps
its name and the arguments text written so far), fed at once or piece by piece."""

from __future__ import annotations

import json

import pytest

from app.openai.tool_calls import ParsedCall, ToolCallMode, ToolCallParser, forced_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {}}'
PARALLEL = f"[{WEATHER}, {TIME}]"
WEATHER_CALL = ParsedCall("get_weather", json.dumps({"city": "Paris", "days": 2}))
TIME_CALL = ParsedCall("get_time", "{}")

CUTS = [
    ("", []),
    ('{"name": "get_we', []),  # inside the name
    ('{"name": "get_weather"', [ParsedCall("get_weather", "", is_complete=False)]),
    ('{"name": "get_weather", "argu', [ParsedCall("get_weather", "", is_complete=False)]),
    ('{"name": "get_weather", "arguments": ', [ParsedCall("get_weather", "", is_complete=False)]),
    (
        '{"name": "get_weather", "arguments": {"city": "Par',
        [ParsedCall("get_weather", '{"city": "Par', is_complete=False)],
    ),
    (WEATHER[:-1], [WEATHER_CALL]),  # only the closing brace: the arguments are whole
    (WEATHER, [WEATHER_CALL]),
    ("[", []),
    (
        '[{"name": "get_weather", "arguments": {"ci',
        [ParsedCall("get_weather", '{"ci', is_complete=False)],
    ),
    (f"[{WEATHER}", [WEATHER_CALL]),  # after a whole element
    (f"[{WEATHER}, ", [WEATHER_CALL]),  # between elements
    (f'[{WEATHER}, {{"name": "get_ti', [WEATHER_CALL]),
    (
        f'[{WEATHER}, {{"name": "get_time", "arguments": {{',
        [WEATHER_CALL, ParsedCall("get_time", "{", is_complete=False)],
    ),
    (PARALLEL[:-1], [WEATHER_CALL, TIME_CALL]),
    (PARALLEL, [WEATHER_CALL, TIME_CALL]),
    (
        '[\n {"name": "get_time",\n "arguments": {"a": [1, 2',
        [ParsedCall("get_time", '{"a": [1, 2', is_complete=False)],
    ),
]


@pytest.mark.parametrize(("text", "calls"), CUTS)
def test_forced_calls_keep_the_whole_calls_and_the_cut_one(text: str, calls: list) -> None:
    assert forced_calls(text) == calls


@pytest.mark.parametrize(("text", "calls"), CUTS)
def test_forced_output_streamed_piece_by_piece_is_never_content(text: str, calls: list) -> None:
    parser = ToolCallParser(ToolCallMode.FORCED)
    pieces = [text[start : start + 3] for start in range(0, len(text), 3)]
    assert [parser.feed(piece) for piece in pieces] == [""] * len(pieces)
    assert parser.finish() == ("", calls)


@pytest.mark.parametrize(
    ("cut_at", "calls"),
    [
        (5, []),  # inside the name: no call, and no markup as content
        (30, [ParsedCall("get_weather", "", is_complete=False)]),  # before "arguments"
        (50, [ParsedCall("get_weather", '{"city": "Par', is_complete=False)]),
        (len(WEATHER), [WEATHER_CALL]),  # only the closing tag cut
    ],
)
def test_a_cut_auto_call_is_a_call_never_markup(cut_at, calls) -> None:
    parser = ToolCallParser(ToolCallMode.AUTO)
    text = f"Let me check.\n<tool_call>\n{WEATHER[:cut_at]}"
    assert parser.feed(text) == "Let me check."
    assert parser.finish() == ("", calls)
