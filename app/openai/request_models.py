"""The OpenAI requests kvshare serves: chat completions and completions. They refuse unknown
fields (extra="forbid"), take no coerced value (strict), and carry to_sampling_params(); the
parts they are made of are in app/openai/request_parts.py."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SkipValidation, Strict

from app.openai.json_schema import canonical_text
from app.openai.request_parts import (
    ChatMessage,
    NamedToolChoice,
    RequestModel,
    ResponseFormat,
    StreamOptions,
    Tool,
)
from app.openai.structured_output import (
    response_format_schema,
    structured_output,
    tool_structured_output,
)
from engine.core.errors import ParamError
from engine.core.protocol import MAX_PRIORITY, MIN_PRIORITY
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.seeds import MAX_SEED

# OpenAI's ranges (and the engine's, engine/core/sampling_params.py), declared on the fields
# so that pydantic refuses a value outside them with a 400 naming the field and the OpenAPI
# document shows them. Caps a server may set lower (n, stop strings, ...) are settings, checked
# in app/serving/limits.py.
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]  # 0 would keep no token at all
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Count = Annotated[int, Field(ge=1)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Priority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]  # lower runs first
TokenId = Annotated[int, Field(ge=0)]
TokenIdKey = Annotated[int, Strict(False), Field(ge=0)]  # JSON object keys are strings: "5"


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


class CacheDiagnosticsOptions(RequestModel):
    compare_to: str | None = None  # the id of an earlier completion of the same tenant


class _SamplingRequest(RequestModel):
    """The fields chat and completions share; None (or null) means "use the default"."""

    # A max_tokens past the context window's room is capped to it instead of refused (the
    # Anthropic route's chat requests, app/anthropic/request.py).
    caps_max_tokens: ClassVar[bool] = False

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
    # true, or {"compare_to": ID}: the response says why the prompt missed the prefix cache
    # (docs/cache-diagnostics.md).
    cache_diagnostics: bool | CacheDiagnosticsOptions | None = None
    priority: Priority | None = None  # vLLM's meaning: lower runs first (within a tenant)
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
    def response_schema_text(self) -> str | None:
        """response_format's json_schema.schema as canonical JSON (None without one), made once
        per request: app/serving/limits.py caps its size, structured_output checks it and
        sends it."""
        return canonical_text(response_format_schema(self.response_format), "response_format")

    @cached_property
    def structured(self) -> StructuredOutput | None:
        """The output constraint response_format asks for (checked once per request)."""
        return structured_output(self.response_format, self.response_schema_text)

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
    def tool_schema_texts(self) -> list[str | None]:
        """Each tool's parameters as canonical JSON (None where it has none), made once per
        request, as response_schema_text is."""
        return [
            canonical_text(tool.function.parameters, f"tools[{number}].function.parameters")
            for number, tool in enumerate(self.tools or [])
        ]

    @cached_property
    def structured(self) -> StructuredOutput | None:
        """response_format's constraint, or the one tool_choice asks for (never both)."""
        mode = self.tool_mode
        response_format = structured_output(self.response_format, self.response_schema_text)
        if mode in (None, "none"):
            return response_format
        if response_format is not None:
            message = 'response_format cannot be combined with tools unless tool_choice is "none"'
            raise ParamError("response_format", message)
        texts = self.tool_schema_texts
        return tool_structured_output(
            self.tools or [], mode, self.tool_choice, self.parallel_calls, texts
        )

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
