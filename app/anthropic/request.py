"""Anthropic's Messages request and its translation into a chat request (the blocks of its
turns: app/anthropic/content.py).

Served by the chat pipeline as it is, like a Responses request: to_chat_request() turns system,
messages, tools and tool_choice into a ChatCompletionRequest, so templating, tool grammars and
the prefix cache are the chat path's own. Thinking blocks are dropped, as Anthropic drops
earlier turns' thinking; cache_control breakpoints change nothing (the cache is automatic).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from app.anthropic.content import (
    TOOL_NAME,
    CacheControl,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from app.openai.request_models import CacheDiagnosticsOptions, ChatCompletionRequest
from app.openai.request_parts import RequestModel, validated_part
from engine.core.errors import ParamError

# A line agents put first in the system prompt that changes between sessions or requests
# (Claude Code's attribution line, `cc_version=<version>.<hash>; ... cch=<hash>;`).
VOLATILE_SYSTEM_LINE = re.compile(r"x-anthropic-billing-header:[^\n]*(?:\n|$)")


class MessagesParamError(ParamError):
    """A 400 that names the Messages field itself (the route renames only chat fields)."""


class Metadata(RequestModel):
    user_id: str | None = None


class Diagnostics(RequestModel):
    """Anthropic's cache diagnostics: why this prompt could not reuse the one of the Message
    `previous_message_id` names (null: opt in with nothing to compare yet)."""

    previous_message_id: str | None = None


def chat_id_of(message_id: str) -> str:
    """A Message's id is its chat response's ("msg_X" <-> "chatcmpl-X")."""
    return "chatcmpl-" + message_id.removeprefix("msg_")


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(discriminator="type"),
]


class CustomTool(RequestModel):
    """A client tool; Anthropic's own (bash_20250124, web_search_..., ...) are refused."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # the schema is always enforced in full
    # accepted, without effect: the whole input comes in one delta; examples, callers
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None
    defer_loading: Literal[False] | None = None  # true asks for tool search: not served

    def to_chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class _ChatRequest(ChatCompletionRequest):
    """The chat request a Messages request becomes: max_tokens past the context window is
    capped to the room left (agents send 32k whatever the model), not refused."""

    caps_max_tokens: ClassVar[bool] = True


class MessagesConversation(RequestModel):
    """What count_tokens and create share: the prompt, tools and the options that shape it.

    thinking, context_management and output_config.effort are accepted and change nothing:
    the served model has no reasoning mode, so no thinking blocks are made (docs/anthropic.md).
    output_config.format (a JSON schema) is enforced as the chat route's response_format.
    """

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None
    # accepted, without effect here: the cache is automatic, there is one speed
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    # kvshare extensions, as on the OpenAI routes
    cache_salt: str | None = None
    cache_diagnostics: bool | CacheDiagnosticsOptions | None = None

    def custom_tools(self) -> list[CustomTool] | None:
        if self.tools is None:
            return None
        tools = []
        for number, tool in enumerate(self.tools):
            if tool.get("type") not in (None, "custom"):
                message = f"tools[{number}].type {tool.get('type')!r}: only client tools are served"
                raise MessagesParamError(f"tools[{number}].type", message)
            where = f"tools[{number}]"
            tools.append(validated_part(CustomTool, tool, where, MessagesParamError))
        return tools

    def check_thinking(self, max_tokens: int | None) -> None:
        kind = (self.thinking or {}).get("type", "disabled")
        if kind not in ("enabled", "disabled", "adaptive"):
            message = 'thinking.type must be "enabled", "disabled" or "adaptive"'
            raise MessagesParamError("thinking.type", message)
        budget = (self.thinking or {}).get("budget_tokens")
        if kind == "enabled" and not (isinstance(budget, int) and budget >= 1024):
            message = "thinking.budget_tokens must be an integer of at least 1024"
            raise MessagesParamError("thinking.budget_tokens", message)
        if kind == "enabled" and max_tokens is not None and budget >= max_tokens:
            message = "thinking.budget_tokens must be less than max_tokens"
            raise MessagesParamError("thinking.budget_tokens", message)

    def system_text(self, strip_volatile: bool) -> str | None:
        """The system prompt as one text (blocks joined by newlines); with strip_volatile,
        without the volatile lines it starts with (VOLATILE_SYSTEM_LINE)."""
        if self.system is None:
            return None
        system = self.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        while strip_volatile and (match := VOLATILE_SYSTEM_LINE.match(text)):
            text = text[match.end() :]
        return text

    def has_volatile_system_line(self) -> bool:
        text = self.system_text(strip_volatile=False)
        return text is not None and VOLATILE_SYSTEM_LINE.match(text) is not None

    def chat_fields(
        self, strip_volatile: bool, max_tokens: int | None = None, diagnose: Any = None
    ) -> dict[str, Any]:
        """The chat request's fields that come from the conversation; `diagnose`: the
        cache_diagnostics that Anthropic's own `diagnostics` asks for (MessagesRequest)."""
        self.check_thinking(max_tokens)
        tools = self.custom_tools()
        system = self.system_text(strip_volatile)
        messages = [{"role": "system", "content": system}] if system else []
        messages += chat_messages(self.messages)
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if tools:
            fields["tools"] = [tool.to_chat_tool() for tool in tools]
        fields |= _chat_tool_choice(self.tool_choice, tools)
        if (output_format := self._output_format()) is not None:
            fields["response_format"] = output_format
        last = messages[-1]
        if last["role"] == "assistant" and not last.get("tool_calls"):
            if last["content"]:
                fields["continue_final_message"] = True  # a prefilled answer is continued
            elif len(messages) > 1:
                messages.pop()  # an answer of thinking alone: nothing to continue
        diagnostics = self._diagnostics() or diagnose
        optional = {"cache_salt": self.cache_salt, "cache_diagnostics": diagnostics}
        return fields | {name: value for name, value in optional.items() if value is not None}

    def _output_format(self) -> dict[str, Any] | None:
        """output_config.format as the chat route's response_format (None without one)."""
        given = (self.output_config or {}).get("format")
        if given is None:
            return None
        if not (isinstance(given, dict) and given.get("type") == "json_schema"):
            message = 'output_config.format must be {"type": "json_schema", "schema": {...}}'
            raise MessagesParamError("output_config.format", message)
        if set(given) != {"type", "schema"} or not isinstance(given["schema"], dict):
            message = "output_config.format takes `type` and `schema` (an object), nothing else"
            raise MessagesParamError("output_config.format", message)
        spec = {"name": "output", "schema": given["schema"]}
        return {"type": "json_schema", "json_schema": spec}

    def _diagnostics(self) -> Any:
        """The cache_diagnostics extension as the chat request takes it (a Message id in
        compare_to is its chat response's)."""
        option = self.cache_diagnostics
        if not isinstance(option, CacheDiagnosticsOptions):
            return option
        earlier = option.compare_to
        if earlier is not None and earlier.startswith("msg_"):
            earlier = chat_id_of(earlier)
        return {"compare_to": earlier}

    def to_chat_request(self, strip_volatile: bool = False) -> ChatCompletionRequest:
        return _ChatRequest.model_validate(self.chat_fields(strip_volatile), strict=False)


class MessagesRequest(MessagesConversation):
    """POST /v1/messages. temperature is Anthropic's 0..1; metadata.user_id is the `user`
    fair share may schedule by; service_tier is accepted (one tier here)."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    diagnostics: Diagnostics | None = None
    inference_geo: str | None = None  # accepted, without effect: one place

    def to_chat_request(
        self,
        strip_volatile: bool = False,
        max_output_tokens: int | None = None,
        previous_chat_id: str | None = None,
    ) -> ChatCompletionRequest:
        """max_tokens is a bound: capped at max_output_tokens here, at the context window's
        room by serving (agents send 32k or 64k whatever the model). previous_chat_id: the
        chat id of diagnostics.previous_message_id, once the route knows the tenant has it."""
        max_tokens = min(self.max_tokens, max_output_tokens or self.max_tokens)
        diagnose = None
        if self.diagnostics is not None:  # Anthropic's own: a comparison when there is one
            diagnose = {"compare_to": previous_chat_id} if previous_chat_id else True
        fields = self.chat_fields(strip_volatile, self.max_tokens, diagnose)
        fields["max_tokens"] = max_tokens
        optional = {
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "user": self.metadata.user_id if self.metadata else None,
        }
        fields |= {name: value for name, value in optional.items() if value is not None}
        return _ChatRequest.model_validate(fields, strict=False)


def _chat_tool_choice(choice: ToolChoice | None, tools: list[CustomTool] | None) -> dict:
    """tool_choice and parallel_tool_calls of the chat request."""
    if choice is None or not tools:
        if isinstance(choice, ToolChoiceAny | ToolChoiceTool):
            raise MessagesParamError("tool_choice", f'tool_choice "{choice.type}" needs tools')
        return {}
    fields: dict[str, Any] = {}
    if getattr(choice, "disable_parallel_tool_use", None):
        fields["parallel_tool_calls"] = False
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in {tool.name for tool in tools}:
            message = f"tool_choice.name {choice.name!r} is not one of the tools"
            raise MessagesParamError("tool_choice.name", message)
        named = {"type": "function", "function": {"name": choice.name}}
        return fields | {"tool_choice": named}
    return fields | {"tool_choice": {"auto": "auto", "any": "required"}.get(choice.type, "none")}


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The turns as chat messages: a user turn's tool_result blocks become tool messages (in
    order, its text between them a user message), an assistant's tool_use blocks its
    tool_calls; thinking blocks are dropped. A tool_result must answer an earlier tool_use."""
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(message.content, where, call_ids))
        else:
            out += _user(message.role, message.content, where, call_ids)
    return out


def _assistant(blocks: list, where: str, call_ids: set[str]) -> dict[str, Any]:
    texts, calls = [], []
    for number, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            call_ids.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            param = f"{where}.content[{number}]"
            raise MessagesParamError(param, f"{param}: tool_result blocks belong in user turns")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""  # only thinking: an empty answer
    return message


def _user(role: str, blocks: list, where: str, call_ids: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for number, block in enumerate(blocks):
        param = f"{where}.content[{number}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock) and role == "user":
            if block.tool_use_id not in call_ids:
                message = f"{param}.tool_use_id {block.tool_use_id!r} answers no earlier tool_use"
                raise MessagesParamError(f"{param}.tool_use_id", message)
            if texts:
                out.append({"role": role, "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            raise MessagesParamError(
                param, f"{param}: a {block.type} block cannot be in a {role} turn"
            )
    if texts or not out:
        out.append({"role": role, "content": "\n".join(texts)})
    return out
