"""OpenAI wire models. Requests refuse unknown fields (extra="forbid") and carry
to_sampling_params(); responses follow the shapes of OpenAI's openapi.yaml."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, TypeAdapter, ValidationError

from app.json_schema import check_schema
from engine.core.errors import ParamError
from engine.core.sampling_params import SamplingParams, StructuredOutput

MAX_N = 128  # choices per prompt; more would only fill the queue
MAX_STOP_STRINGS = 16  # stop strings are matched on every token


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- requests ------------------------------------------------------------------------------


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """system / developer / user / assistant; content as a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it. `developer` is OpenAI's new name for system."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content, "name": self.name}


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
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int | None, Field(le=MAX_N)] = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Checked by structured_output(), not by pydantic: the schema documents the real shape.
    response_format: Annotated[ResponseFormat | None, SkipValidation] = None
    # Extensions beyond the OpenAI API (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
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

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            structured=self.structured,
            **{name: value for name, value in given.items() if value is not None},
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Chat template extensions (vLLM / SGLang names).
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = None  # null: true, or false with continue_final_message
    # Reasoning output (SGLang): kvshare has no reasoning parser, so the text is never split
    # and both values give the same response, as on SGLang without --reasoning-parser.
    separate_reasoning: bool | None = True
    stream_reasoning: bool | None = True

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
    logprobs: int | None = None
    echo: bool | None = False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams with `max_tokens` already resolved (see OpenAIServing)."""
        if self.echo and self.logprobs is not None:
            raise ParamError("echo", "echo together with logprobs is not supported")
        return self._sampling_params(max_tokens, self.logprobs)


# -- responses -----------------------------------------------------------------------------

FinishReasonName = Literal["stop", "length"]


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


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
    delta: dict[str, str]  # {"role": ...} and/or {"content": ...}; absent keys are omitted
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
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
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
