"""Formatting for the OpenAI endpoints: ChoiceDeltas (from app/serving.py) -> the response
models and stream chunks of app/protocol.py, one Formatter per endpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from app.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    Usage,
)
from engine.core.protocol import TokenLogprob


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
