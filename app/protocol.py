"""OpenAI wire models. Requests refuse unknown fields (extra="forbid") and carry
to_sampling_params(); responses follow the shapes of OpenAI's openapi.yaml."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from engine.protocol import TokenLogprob
from engine.sampling_params import ParamError, SamplingParams

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


class ResponseFormat(_Request):
    """Only plain text: JSON modes and schemas are refused (type must be "text")."""

    type: Literal["text"]


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
    # Extensions beyond the OpenAI API (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            **{name: value for name, value in given.items() if value is not None},
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

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


# -- formatting: ChoiceDeltas -> responses and chunks ---------------------------------------


@dataclass
class ChoiceDelta:
    """What one choice produced since its previous delta (plain data, from app/serving.py)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # in the choice's generated text
    finish_reason: str | None = None


class _TokenNames(Protocol):
    def token_text(self, token_id: int) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...


class Formatter:
    """Builds one endpoint's response and chunks; shared header fields live here."""

    def __init__(
        self,
        response_id: str,
        model: str,
        fingerprint: str,
        tokenizer: _TokenNames,
        want_logprobs: bool,
    ) -> None:
        self.header = {
            "id": response_id,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": fingerprint,
        }
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs

    def response(self, num_choices: int, deltas: list[ChoiceDelta], usage: Usage) -> BaseModel:
        raise NotImplementedError

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        return []

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    @staticmethod
    def dump_chunk(chunk: BaseModel, include_usage: bool) -> dict[str, Any]:
        """With include_usage every chunk carries "usage" (null but in the last one)."""
        data = chunk.model_dump(mode="json")
        if not include_usage:
            data.pop("usage", None)
        return data

    @staticmethod
    def fold(num_choices: int, deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
        """All deltas of each choice merged into one, in index order."""
        folded = [ChoiceDelta(index) for index in range(num_choices)]
        for delta in deltas:
            whole = folded[delta.index]
            whole.text += delta.text
            whole.token_ids += delta.token_ids
            whole.logprobs += delta.logprobs
            whole.text_offsets += delta.text_offsets
            whole.finish_reason = delta.finish_reason or whole.finish_reason
        return folded


class ChatFormatter(Formatter):
    def response(
        self, num_choices: int, deltas: list[ChoiceDelta], usage: Usage
    ) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=whole.index,
                message=ChatResponseMessage(content=whole.text),
                logprobs=self._logprobs(whole),
                finish_reason=whole.finish_reason or "stop",
            )
            for whole in self.fold(num_choices, deltas)
        ]
        return ChatCompletionResponse(**self.header, choices=choices, usage=usage)

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        """The first delta of every choice carries the role."""
        return [
            self._chunk([ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
            for i in range(num_choices)
        ]

    def chunk(self, delta: ChoiceDelta) -> ChatCompletionChunk | None:
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None
        choice = ChatChunkChoice(
            index=delta.index,
            delta={"content": delta.text} if delta.text else {},
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
        )
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(**self.header, choices=choices, usage=usage)

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(lp) for lp in delta.logprobs])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        raw = self.tokenizer.token_bytes(token_id)
        return TopLogprob(
            token=self.tokenizer.token_text(token_id), logprob=logprob, bytes=list(raw)
        )

    def _token_logprob(self, lp: TokenLogprob) -> ChatTokenLogprob:
        top = [self._top(token_id, logprob) for token_id, logprob in lp.top_logprobs]
        sampled = self._top(lp.token_id, lp.logprob)
        return ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top)


class CompletionFormatter(Formatter):
    def __init__(self, *, echo_texts: list[str] | None, n: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo_texts = echo_texts
        self.n = n  # choices per prompt: choice i belongs to prompt i // n

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts is not None else ""

    def response(
        self, num_choices: int, deltas: list[ChoiceDelta], usage: Usage
    ) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=whole.index,
                text=self._echo(whole.index) + whole.text,
                logprobs=self._logprobs(whole),
                finish_reason=whole.finish_reason or "stop",
            )
            for whole in self.fold(num_choices, deltas)
        ]
        return CompletionResponse(**self.header, choices=choices, usage=usage)

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        """With echo, each choice's stream starts with its prompt."""
        if self.echo_texts is None:
            return []
        return [
            CompletionResponse(
                **self.header, choices=[CompletionChoice(index=i, text=self._echo(i))]
            )
            for i in range(num_choices)
        ]

    def chunk(self, delta: ChoiceDelta) -> CompletionResponse | None:
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(delta),
            finish_reason=delta.finish_reason,
        )
        return CompletionResponse(**self.header, choices=[choice])

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**self.header, choices=[], usage=usage)

    def _logprobs(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        name = self.tokenizer.token_text
        return CompletionLogprobs(
            tokens=[name(lp.token_id) for lp in delta.logprobs],
            token_logprobs=[lp.logprob for lp in delta.logprobs],
            top_logprobs=[{name(t): v for t, v in lp.top_logprobs} for lp in delta.logprobs],
            text_offset=delta.text_offsets[: len(delta.logprobs)],
        )
