"""POST /v1/responses: the request model and its translation into a chat request.

A Responses request is served by the chat pipeline as it is: to_chat_request() turns the
input items, instructions, tools, tool_choice and text.format into a ChatCompletionRequest,
so templating, tool grammars and xgrammar structured output are the chat path's own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from app.openai.request_models import ChatCompletionRequest, Seed, Temperature, TopP
from app.openai.request_parts import RequestModel, validated_part
from engine.core.errors import ParamError

# Fields kvshare cannot honour: accepted only at the value that asks for nothing.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "reasoning": (None, "reasoning options are not supported"),
    "background": (False, "background responses are not supported"),
    "conversation": (None, "conversations are not supported"),
    "prompt": (None, "prompt templates are not supported"),
}


class ResponseFunctionTool(RequestModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        function |= {"parameters": self.parameters, "strict": self.strict}
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }


class ResponseNamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class ResponseTextConfig(RequestModel):
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(RequestModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=16)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseTextConfig | None = None
    store: bool | None = True
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    cache_salt: str | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None

    def check_unsupported(self) -> None:
        for name, (no_op, reason) in _UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value != no_op:
                raise ParamError(name, f"{name}: {reason}")

    def function_tools(self) -> list[ResponseFunctionTool] | None:
        if self.tools is None:
            return None
        tools = []
        for number, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                message = f"tool type {tool.get('type')!r} is not supported (only 'function')"
                raise ParamError(f"tools[{number}].type", message)
            tools.append(validated_part(ResponseFunctionTool, tool, f"tools[{number}]"))
        return tools

    @property
    def is_stored(self) -> bool:
        return self.store is not False  # OpenAI's default: stored

    def to_chat_request(self, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat request that serves this one, after `history` (the items of the chain
        previous_response_id continues); ParamError names our fields."""
        self.check_unsupported()
        tools = self.function_tools()
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(history or [])}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "user": self.user,
            "cache_salt": self.cache_salt,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [tool.to_chat_tool() for tool in tools] if tools else None,
            "tool_choice": self._chat_tool_choice(),
            "response_format": self._response_format(),
        }
        body |= {name: value for name, value in optional.items() if value is not None}
        return ChatCompletionRequest.model_validate(body, strict=False)

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, ResponseNamedToolChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def _response_format(self) -> dict[str, Any] | None:
        fmt = None if self.text is None else self.text.format
        if fmt is None or fmt.get("type") != "json_schema":
            return fmt
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages: instructions as the system message, then the chain's items
        (`history`, already valid), then the input items."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            given = [{"type": "message", "role": "user", "content": self.input}]
        elif not self.input:
            raise ParamError("input", "input must not be empty")
        else:
            given = self.input
        return messages + input_messages([*history, *given], num_history=len(history))


def input_messages(items: list[dict[str, Any]], num_history: int = 0) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function_calls make one assistant message.

    The first `num_history` items are a stored chain's (errors name the input items after
    them); a function_call_output may answer a call of the chain or of the input."""
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for number, item in enumerate(items):
        where = f"input[{number - num_history}]" if number >= num_history else "history"
        if not isinstance(item, dict):
            raise ParamError(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            call_ids.add(call["id"])
            previous = messages[-1] if messages else None
            if previous is not None and previous.get("tool_calls") and not previous["content"]:
                previous["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_output(item, where, call_ids))
        else:
            raise ParamError(f"{where}.type", f"{where}.type {kind!r} is not supported")
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(f"{where}.content", f"{where}.content must be a string or a list")
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            message = f"{where}.content[{number}]: only input_text and output_text parts"
            raise ParamError(f"{where}.content[{number}]", message)
        texts.append(part["text"])
    return "".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ParamError(f"{where}.role", f"{where}.role {role!r} is not supported")
    return {"role": role, "content": _text(item.get("content"), where)}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ParamError(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    function = {
        "name": _string(item, "name", where),
        "arguments": _string(item, "arguments", where),
    }
    return {"id": call_id, "type": "function", "function": function}


def _function_output(item: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    if call_id not in call_ids:
        message = (
            f"{where}.call_id {call_id!r} matches no function_call before it"
            " (in this input or in the chain of previous_response_id)"
        )
        raise ParamError(f"{where}.call_id", message)
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, where)
    return {"role": "tool", "tool_call_id": call_id, "content": text}
