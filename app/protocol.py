"""OpenAI wire models. Requests refuse unknown fields (extra="forbid") and carry
to_sampling_params(); responses follow the shapes of OpenAI's openapi.yaml."""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    SkipValidation,
    Strict,
    TypeAdapter,
    ValidationError,
    model_serializer,
)

from app.json_schema import WHERE as SCHEMA_WHERE
from app.json_schema import SchemaRefused, canonical_json, check_schema
from engine.core.errors import ParamError
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.seeds import MAX_SEED

# OpenAI's ranges (and the engine's, engine/core/sampling_params.py), declared on the fields
# so that pydantic refuses a value outside them with a 400 naming the field and the OpenAPI
# document shows them. Caps a server may set lower (n, stop strings, ...) are settings, checked
# in app/limits.py.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]  # 0 would keep no token at all
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Count = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[int, Strict(False), Field(ge=0)]  # JSON object keys are strings: "5"


class _Request(BaseModel):
    # strict: a JSON value of the wrong type is refused, never coerced ("2" is no number,
    # true is no 1.0, "yes" is no boolean), as the OpenAPI document says.
    model_config = ConfigDict(extra="forbid", strict=True)


# -- requests ------------------------------------------------------------------------------


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """A call in the history: `arguments` is JSON text (checked by ChatMessage.check)."""

    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Request):
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


class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: a function that takes no arguments
    strict: Annotated[bool | None, Field(strict=True)] = None  # always enforced in full


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


MAX_PARALLEL_TOOL_CALLS = 8  # calls in one "required" answer with parallel_tool_calls
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormatText(_Request):
    """Plain text: no constraint."""

    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    """Any JSON object (the output is constrained to one by a grammar)."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Request):
    """OpenAI's ResponseFormatJsonSchema.json_schema. The whole schema is always enforced:
    `strict` true and false both get full enforcement (never a weaker, "best effort" one)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: Annotated[bool | None, Field(strict=True)] = None  # a JSON boolean, not "yes"


class ResponseFormatJsonSchema(_Request):
    """JSON that conforms to json_schema.schema (see app/json_schema.py for the keywords)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]
_RESPONSE_FORMAT: TypeAdapter[Any] = TypeAdapter(ResponseFormat)


def structured_output(response_format: Any) -> StructuredOutput | None:
    """The engine's constraint for a raw `response_format` value; ParamError names the problem.

    Validated here rather than as a pydantic field so that every error says exactly what is
    wrong with response_format (the generic validation handler would only name the field).
    """
    if response_format is None:
        return None
    try:
        parsed = _RESPONSE_FORMAT.validate_python(response_format)
    except ValidationError as e:
        raise ParamError("response_format", _response_format_message(e, response_format)) from e
    if isinstance(parsed, ResponseFormatText):
        return None
    if isinstance(parsed, ResponseFormatJsonObject):
        return StructuredOutput("json_object")
    if parsed.json_schema.schema_ is None:
        message = 'response_format of type "json_schema" needs json_schema.schema (an object)'
        raise ParamError("response_format", message)
    return StructuredOutput("json_schema", check_schema(parsed.json_schema.schema_))


def _response_format_message(error: ValidationError, response_format: Any) -> str:
    first = error.errors()[0]
    loc = ".".join(str(part) for part in first["loc"][1:])  # [0] is the union tag
    kind = first["type"]
    if kind in ("union_tag_invalid", "union_tag_not_found", "model_attributes_type"):
        given = response_format.get("type") if isinstance(response_format, dict) else None
        got = f", got {given!r}" if given is not None else ""
        return f'response_format.type must be "text", "json_object" or "json_schema"{got}'
    if kind == "extra_forbidden":
        owner = "json_schema" if loc.startswith("json_schema.") else f'type "{first["loc"][0]}"'
        field = loc.split(".")[-1]
        return f"response_format: {owner} takes no field '{field}'"
    if kind == "missing":
        return f"response_format.{loc} is required"
    return f"response_format.{loc}: {first['msg']}"


def tool_structured_output(
    tools: list[Tool], mode: str, tool_choice: NamedToolChoice | str | None, parallel: bool = True
) -> StructuredOutput:
    """The grammar behind a tool_choice other than "none".

    "auto": text, where every `<tool_call>` must be completed as a valid call (kind
    "tool_calls"). "named": exactly `{"name": NAME, "arguments": ARGS}`. "required": one such
    object for any of the tools, or with parallel calls an array of 1 to
    MAX_PARALLEL_TOOL_CALLS of them (bounded, so that a model cannot add calls forever).
    The text keeps "name" before "arguments" (the grammar writes properties in schema order,
    and a streamed call starts with its name); the parameters are canonical (sorted keys).
    """
    parameters = {
        tool.function.name: _tool_parameters(number, tool) for number, tool in enumerate(tools)
    }
    if mode == "auto":
        listed = [{"name": name, "parameters": schema} for name, schema in parameters.items()]
        return StructuredOutput("tool_calls", canonical_json(listed))
    calls = [_call_schema(name, schema) for name, schema in parameters.items()]
    if mode == "named":
        assert isinstance(tool_choice, NamedToolChoice)
        schema = _call_schema(tool_choice.function.name, parameters[tool_choice.function.name])
    else:
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if parallel:
            schema = {
                "type": "array",
                "items": schema,
                "minItems": 1,
                "maxItems": MAX_PARALLEL_TOOL_CALLS,
            }
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")))


def _tool_parameters(number: int, tool: Tool) -> dict[str, Any]:
    """tools[number]'s parameters schema, checked as response_format schemas are."""
    schema = tool.function.parameters
    if schema is None:
        return NO_ARGUMENTS
    param = f"tools[{number}].function.parameters"
    try:
        return json.loads(check_schema(schema))  # canonical: equal schemas, equal grammars
    except SchemaRefused as e:
        raise ParamError(param, e.message.replace(SCHEMA_WHERE, param)) from e


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# Extension fields that select something kvshare does not do: accepted only at the value that
# asks for nothing (null / false), refused with a 400 naming the field otherwise.
# field -> (its no-op value, what kvshare would have to do for any other value).
_NO_OP_FIELDS: dict[str, tuple[Any, str]] = {
    "return_hidden_states": (False, "returning hidden states is not supported"),
    "lora_path": (None, "LoRA adapters are not supported"),
    "rid": (None, "client-chosen request ids are not supported; the server picks the id"),
    "session_params": (None, "sessions are not supported"),
    "regex": (None, "constrained decoding (regex) is not supported"),
    "ebnf": (None, "constrained decoding (ebnf) is not supported"),
    "json_schema": (None, "constrained decoding (json_schema) is not supported"),
}


class _SamplingRequest(_Request):
    """The fields chat and completions share; None (or null) means "use the default"."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Count | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Checked by structured_output(), not by pydantic: the schema documents the real shape.
    response_format: Annotated[ResponseFormat | None, SkipValidation] = None
    # Extensions beyond the OpenAI API (vLLM names).
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1: off; 0 is refused (engine)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[TokenId] | None = None
    cache_salt: str | None = None
    skip_special_tokens: bool | None = True  # false: special tokens stay in the text
    no_stop_trim: bool | None = False  # SGLang's name: keep the matched stop in the text
    include_stop_str_in_output: bool | None = False  # vLLM's name for the same
    # SGLang extensions, accepted only at their no-op value (see _NO_OP_FIELDS).
    return_hidden_states: bool | None = False
    lora_path: str | list[str | None] | None = None
    rid: str | list[str] | None = None
    session_params: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def keeps_stop(self) -> bool:
        """The matched stop string (or stop token) stays in the text: no_stop_trim (SGLang)
        or include_stop_str_in_output (vLLM)."""
        return bool(self.no_stop_trim or self.include_stop_str_in_output)

    @cached_property
    def structured(self) -> StructuredOutput | None:
        """The output constraint response_format asks for (checked once per request)."""
        return structured_output(self.response_format)

    @property
    def skips_special_tokens(self) -> bool:
        return self.skip_special_tokens is not False  # null means the default, true

    def check_no_op_fields(self) -> None:
        """ParamError naming the first extension field set to something kvshare does not do."""
        for name, (no_op, reason) in _NO_OP_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value != no_op:
                raise ParamError(name, f"{name}={value!r}: {reason}")

    def _sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        self.check_no_op_fields()
        given = {
            "n": self.n,
            "min_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
        }
        return SamplingParams(
            max_tokens=max_tokens,
            logit_bias=dict(self.logit_bias or {}),
            stop=self.stop_strings,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=self.structured,
            **{name: value for name, value in given.items() if value is not None},
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    # Chat template extensions (vLLM / SGLang names).
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = None  # null: true, or false with continue_final_message
    # Reasoning output (SGLang): kvshare has no reasoning parser, so the text is never split
    # and both values give the same response, as on SGLang without --reasoning-parser.
    separate_reasoning: bool | None = True
    stream_reasoning: bool | None = True
    # Function tools (see tool_mode and README "Tools").
    tools: Annotated[list[Tool] | None, Field(min_length=1)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # null: true

    def check_messages(self) -> None:
        """ParamError naming the first message field pydantic cannot check."""
        for number, message in enumerate(self.messages):
            message.check(f"messages[{number}]")

    @cached_property
    def tool_mode(self) -> str | None:
        """None without tools, else "none", "auto" (the default), "required" or "named"."""
        if self.tools is None:
            if self.tool_choice is not None:
                raise ParamError("tool_choice", "tool_choice is only allowed when tools are given")
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {tool.function.name for tool in self.tools}:
                message = f"tool_choice names function {name!r}, which is not in tools"
                raise ParamError("tool_choice", message)
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (OpenAI's shape, null fields dropped)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @cached_property
    def structured(self) -> StructuredOutput | None:
        """response_format's constraint, or the one tool_choice asks for (never both)."""
        mode = self.tool_mode
        if mode in (None, "none"):
            return structured_output(self.response_format)
        if structured_output(self.response_format) is not None:
            message = 'response_format cannot be combined with tools unless tool_choice is "none"'
            raise ParamError("response_format", message)
        return tool_structured_output(self.tools or [], mode, self.tool_choice, self.parallel_calls)

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    def template_mode(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message) for the chat template.

        continue_final_message renders the last message, which must be the assistant's, open
        so that the generation continues it; it cannot go with a new generation prompt.
        """
        if not self.continue_final_message:
            return self.add_generation_prompt is not False, False
        if self.add_generation_prompt:
            message = "continue_final_message and add_generation_prompt cannot both be true"
            raise ParamError("continue_final_message", message)
        if self.messages[-1].role != "assistant":
            message = "continue_final_message requires the last message to be the assistant's"
            raise ParamError("continue_final_message", message)
        return False, True

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams with `max_tokens` already resolved; ParamError names our fields."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except ParamError as e:
            renamed = {"logprobs": "top_logprobs"}
            if self.max_completion_tokens is not None:
                renamed["max_tokens"] = "max_completion_tokens"
            raise ParamError(renamed.get(e.param, e.param), e.message) from e


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: echo / score the prompt only
    logprobs: TopLogprobs | None = None
    echo: bool | None = False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams with `max_tokens` already resolved (see OpenAIServing). echo with
        logprobs scores the prompt tokens too; max_tokens 0 generates nothing (OpenAI's
        minimum here: with echo, the prompt alone, as lm-eval's loglikelihood sends it)."""
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


# -- responses -----------------------------------------------------------------------------

FinishReasonName = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    """content is null when the message only calls tools; tool_calls is left out without."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReasonName


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # "role", "content", "tool_calls"; absent keys are omitted
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """With echo the prompt's tokens come first; its first token has null logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonName | None = None


class CompletionResponse(BaseModel):
    """Both the final response and each streamed chunk (the same shape, object too)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvshare"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
