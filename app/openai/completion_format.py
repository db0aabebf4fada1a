"""The completions formatter: ChoiceDeltas -> a CompletionResponse or its chunks, and the
echoed prompt (echo) each choice starts with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from app.openai.formatting import ChoiceDelta, Formatter
from app.openai.response_models import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from engine.core.protocol import TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as echo shows it: its text and, for logprobs, its tokens and their offsets."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # token i starts at text[offset]


def echoed_prompt(tokenizer: Tokenizer, token_ids: list[int], with_tokens: bool) -> EchoedPrompt:
    """The echo of one prompt; with_tokens (logprobs asked) decodes it token by token, so
    each token's offset is where its text starts in the echoed text."""
    if not with_tokens:
        return EchoedPrompt(tokenizer.decode(token_ids))
    detokenizer = IncrementalDetokenizer(tokenizer)
    offsets = []
    for token_id in token_ids:
        offsets.append(detokenizer.num_decoded_chars)
        detokenizer.feed_token(token_id)
    detokenizer.finish()
    return EchoedPrompt(detokenizer.text, list(token_ids), offsets)


class CompletionFormatter(Formatter):
    """With echo (echo_prompts, one per prompt) each choice's text and logprobs start with its
    prompt's; completion offsets count from the start of the echoed text.

    The first prompt token's logprob is null (no logits before it). Streamed, a choice's echo
    chunk goes out with its first delta, which brings the prompt's logprobs (both need the
    prompt computed)."""

    def __init__(self, *, echo_prompts: list[EchoedPrompt] | None, n: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo_prompts = echo_prompts
        self.n = n  # choices per prompt: choice i belongs to prompt i // n
        self._echoed: set[int] = set()  # streaming: choices whose echo chunk is out

    def _echo(self, index: int) -> EchoedPrompt | None:
        return self.echo_prompts[index // self.n] if self.echo_prompts is not None else None

    def has_prompt_logprobs(self, delta: ChoiceDelta) -> bool:
        """A choice's first delta, with echo and logprobs: its echo chunk scores the prompt."""
        is_echoed = self.echo_prompts is not None and delta.index not in self._echoed
        return self.want_logprobs and is_echoed

    def response(
        self, num_choices: int, deltas: list[ChoiceDelta], usage: Usage
    ) -> CompletionResponse:
        choices = []
        for whole in self.fold(num_choices, deltas):
            echo = self._echo(whole.index)
            prompt_part = self._prompt_logprobs(echo, whole.prompt_logprobs)
            choices.append(
                CompletionChoice(
                    index=whole.index,
                    text=(echo.text if echo else "") + whole.text,
                    logprobs=self._logprobs(whole, echo, prompt_part),
                    finish_reason=whole.finish_reason or "stop",
                )
            )
        return CompletionResponse(**self.header, choices=choices, usage=usage)

    def chunks(self, delta: ChoiceDelta) -> list[BaseModel]:
        """With echo, a choice's first delta is preceded by its echo chunk."""
        echo = self._echo(delta.index)
        chunks: list[BaseModel] = []
        if echo is not None and delta.index not in self._echoed:
            self._echoed.add(delta.index)
            prompt_part = self._prompt_logprobs(echo, delta.prompt_logprobs)
            choice = CompletionChoice(index=delta.index, text=echo.text, logprobs=prompt_part)
            chunks.append(CompletionResponse(**self.header, choices=[choice]))
        if delta.text or delta.token_ids or delta.finish_reason:
            choice = CompletionChoice(
                index=delta.index,
                text=delta.text,
                logprobs=self._logprobs(delta, echo, None),
                finish_reason=delta.finish_reason,
            )
            chunks.append(CompletionResponse(**self.header, choices=[choice]))
        return chunks

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**self.header, choices=[], usage=usage)

    def _prompt_logprobs(
        self, echo: EchoedPrompt | None, scored: list[TokenLogprob] | None
    ) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs: null for its first token, then the engine's."""
        if not self.want_logprobs or echo is None:
            return None
        name = self._token_text
        entries: list[TokenLogprob | None] = [None, *(scored or [])]
        entries += [None] * (len(echo.token_ids) - len(entries))  # none lost if the engine erred
        entries = entries[: len(echo.token_ids)]
        return CompletionLogprobs(
            tokens=[name(t) for t in echo.token_ids],
            token_logprobs=[lp.logprob if lp else None for lp in entries],
            top_logprobs=[
                {name(t): v for t, v in lp.top_logprobs} if lp else None for lp in entries
            ],
            text_offset=list(echo.text_offsets),
        )

    def _logprobs(
        self,
        delta: ChoiceDelta,
        echo: EchoedPrompt | None,
        prompt_part: CompletionLogprobs | None,
    ) -> CompletionLogprobs | None:
        """The delta's tokens (after prompt_part, if given); offsets count from the start of
        the choice's text, echo included."""
        if not self.want_logprobs:
            return None
        name = self._token_text
        base = len(echo.text) if echo is not None else 0
        head = prompt_part or CompletionLogprobs(
            tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[]
        )
        return CompletionLogprobs(
            tokens=head.tokens + [name(lp.token_id) for lp in delta.logprobs],
            token_logprobs=head.token_logprobs + [lp.logprob for lp in delta.logprobs],
            top_logprobs=head.top_logprobs
            + [{name(t): v for t, v in lp.top_logprobs} for lp in delta.logprobs],
            text_offset=head.text_offset
            + [base + o for o in delta.text_offsets[: len(delta.logprobs)]],
        )
