"""What a Messages turn holds: Message and its content blocks (text, tool_use, tool_result,
thinking), as Anthropic's API defines them.

cache_control is accepted on every block and changes nothing: the prefix cache is automatic.
app/anthropic/request.py turns these into chat messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from app.openai.request_parts import RequestModel

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class CacheControl(RequestModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # who called it (Anthropic's programmatic calls)
    toolset_name: str | None = None


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        """The result as the chat template's tool message reads it; an error says so."""
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(RequestModel):
    """A turn. `system` turns (a string or text blocks) may come between the others, as
    Claude Code sends them."""

    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]
