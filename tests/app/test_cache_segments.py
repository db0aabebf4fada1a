"""Segments of a chat prompt (app/diagnostics/cache.py) on the tiny tokenizer: the tool
definitions are a segment of their own, wherever the template renders them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_tokenizer import build_tiny_tokenizer

from app.diagnostics.cache import Segment, chat_segments, first_difference_index, segment_at
from engine.chat_template import GENERIC_TOOLS_PROMPT
from engine.tokenizer import Tokenizer

# ChatML that lists the tools in the system block itself, after the system message (Qwen's way).
TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if loop.first and tools %}{{- '\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool['function'] | tojson }}{%- endfor %}"
    "{{- '\\n</tools>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the answer?"},
]


def weather_tool(description: str) -> dict:
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    function = {"name": "weather", "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


TOOLS = [weather_tool("The weather of a city.")]
LISTED = (  # the tool as the generic section and TOOLS_TEMPLATE list it
    '{"name": "weather", "description": "The weather of a city.", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}}}'
)


@pytest.fixture(scope="module")
def takes_tools(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tools"), TOOLS_TEMPLATE))


@pytest.fixture(scope="module")
def generic(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)  # ChatML without tools: the generic section in the system


def kinds(segments: list[Segment]) -> list[tuple[str, int | None]]:
    return [(segment.kind, segment.message_index) for segment in segments]


def span_text(tokenizer: Tokenizer, segments: list[Segment], kind: str, tools=TOOLS) -> str:
    ids = tokenizer.apply_chat_template(MESSAGES, tools=tools)
    index = [segment.kind for segment in segments].index(kind)
    return tokenizer.decode(ids[segments[index].start : segments[index + 1].start], False)


def test_generic_tools_are_their_own_segment_inside_the_system_message(generic) -> None:
    segments = chat_segments(generic, MESSAGES, TOOLS)
    assert kinds(segments) == [
        ("system", 0),
        ("tools", None),
        ("system", 0),  # the system message resumes after the tool definitions
        ("message", 1),
        ("generation_prompt", None),
    ]
    assert span_text(generic, segments, "tools") == "\n\n" + GENERIC_TOOLS_PROMPT.format(
        tools=LISTED
    )


def test_a_template_that_takes_tools_gets_the_span_it_renders(takes_tools) -> None:
    segments = chat_segments(takes_tools, MESSAGES, TOOLS)
    assert kinds(segments) == [
        ("system", 0),
        ("tools", None),
        ("system", 0),
        ("message", 1),
        ("generation_prompt", None),
    ]
    assert span_text(takes_tools, segments, "tools") == f"\n<tools>\n{LISTED}\n</tools>"


def test_without_a_system_message_the_generic_tools_open_the_prompt(generic) -> None:
    user_only = MESSAGES[1:]
    segments = chat_segments(generic, user_only, TOOLS)
    assert kinds(segments) == [("tools", None), ("message", 0), ("generation_prompt", None)]
    ids = generic.apply_chat_template(user_only, tools=TOOLS)
    tools_text = generic.decode(ids[segments[0].start : segments[1].start], False)
    section = GENERIC_TOOLS_PROMPT.format(tools=LISTED)
    assert tools_text == f"<|im_start|>system\n{section}<|im_end|>\n"  # the inserted message


@pytest.mark.parametrize("tokenizer_name", ["generic", "takes_tools"])
def test_prompts_differing_in_a_tool_description_differ_in_the_tools(request, tokenizer_name):
    tokenizer = request.getfixturevalue(tokenizer_name)
    other_tools = [weather_tool("Tomorrow's forecast for a city.")]
    ids = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
    other = tokenizer.apply_chat_template(MESSAGES, tools=other_tools)
    segments = chat_segments(tokenizer, MESSAGES, TOOLS)
    difference = first_difference_index(ids, other)
    assert segment_at(segments, difference) == Segment(segments[1].start, "tools")


def test_no_tools_no_tools_segment(generic) -> None:
    assert "tools" not in [segment.kind for segment in chat_segments(generic, MESSAGES, None)]
    assert "tools" not in [segment.kind for segment in chat_segments(generic, MESSAGES, [])]
