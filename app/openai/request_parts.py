"""The parts OpenAI request bodies are made of: chat messages, function tools, response
formats and stream options, on RequestModel, the strict base every request model shares. The
requests themselves, and their conversion to sampling params, are in
app/openai/request_models.py."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.errors import param_path
from engine.core.errors import ParamError


class RequestModel(BaseModel):
    # strict: a JSON value of the wrong type is refused, never coerced ("2" is no number,
    # true is no 1.0, "yes" is no boolean), as the OpenAPI document says.
    model_config = ConfigDict(extra="forbid", strict=True)


Part = TypeVar("Part", bound=BaseModel)


def validated_part(
    model: type[Part], value: Any, where: str, error: type[ParamError] = ParamError
) -> Part:
    """`value` (one item of a list the request model keeps as plain JSON, e.g. tools[i]) as
    `model`; a bad field is an `error` naming `where`.<field>."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        field = param_path(first["loc"])
        param = f"{where}.{field}" if field else where
        raise error(param, f"{param}: {first['msg']}") from e


# -- chat messages -------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    """A call in the history: `arguments` is JSON text (checked by ChatMessage.check)."""

    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestModel):
    """system / developer / user / assistant / tool; content as a string or text parts.

    An assistant message may carry `tool_calls` (its content may then be null); a tool
    message answers one call (`tool_call_id`). check() says what pydantic cannot.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def check(self, where: str) -> None:
        """ParamError naming the field (`where` is this message's path, "messages[i]")."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ParamError(f"{where}.content", f"{where}.content is required")
        if self.tool_calls and self.role != "assistant":
            raise ParamError(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            message = f"{where}.tool_call_id is required in a tool message"
            raise ParamError(f"{where}.tool_call_id", message)
        for number, call in enumerate(self.tool_calls or []):
            try:
                json.loads(call.function.arguments)
            except ValueError as e:
                param = f"{where}.tool_calls[{number}].function.arguments"
                raise ParamError(param, f"{param} must be a JSON string: {e}") from e

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it. `developer` is OpenAI's new name for system;
        tool call arguments are given as objects, as Hugging Face templates expect."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content, "name": self.name}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


# -- function tools ------------------------------------------------------------------------


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: a function that takes no arguments
    strict: Annotated[bool | None, Field(strict=True)] = None  # always enforced in full


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


# -- stream options and response formats ---------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False


class ResponseFormatText(RequestModel):
    """Plain text: no constraint."""

    type: Literal["text"]


class ResponseFormatJsonObject(RequestModel):
    """Any JSON object (the output is constrained to one by a grammar)."""

    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    """OpenAI's ResponseFormatJsonSchema.json_schema. The whole schema is always enforced:
    `strict` true and false both get full enforcement (never a weaker, "best effort" one)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: Annotated[bool | None, Field(strict=True)] = None  # a JSON boolean, not "yes"


class ResponseFormatJsonSchema(RequestModel):
    """JSON that conforms to json_schema.schema (see app/openai/json_schema.py for the keywords)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]
