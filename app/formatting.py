"""Formatting for the OpenAI endpoints: ChoiceDeltas (from app/serving.py) -> the response
models and stream chunks of app/response_models.py, one Formatter per endpoint."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from app.response_models import (
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
    ResponseFunctionCall,
    ResponseToolCall,
    TopLogprob,
    Usage,
)
from app.tool_calls import ParsedCall, ToolCallMode, ToolCallParser
from engine.core.protocol import TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class ChoiceDelta:
    """What one choice produced since its previous delta (plain data, from app/serving.py)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # in the choice's generated text
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended the choice, if one did
    # echo with logprobs: prompt tokens 1.. scored by the engine, on the choice's first delta
    prompt_logprobs: list[TokenLogprob] | None = None


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
        self._tokens: dict[int, tuple[str, bytes]] = {}  # see _token()

    def response(
        self, num_choices: int, deltas: list[ChoiceDelta], usage: Usage
    ) -> ChatCompletionResponse | CompletionResponse:
        raise NotImplementedError

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and bytes for logprobs, looked up once per response: its entries
        name the same tokens over and over, and a dict hit is ten times cheaper."""
        token = self._tokens.get(token_id)
        if token is None:
            token = (self.tokenizer.token_text(token_id), self.tokenizer.token_bytes(token_id))
            self._tokens[token_id] = token
        return token

    def _token_text(self, token_id: int) -> str:
        return self._token(token_id)[0]

    def response_body(
        self,
        num_choices: int,
        deltas: list[ChoiceDelta],
        usage: Usage,
        extra: dict[str, Any] | None = None,
    ) -> bytes:
        """response() as a JSON body, `extra`'s fields after its own. Blocking: with
        logprobs, a second or more near max_logprob_entries (serving runs it off the loop).

        Dumped a choice at a time and encoded a part at a time (json_body): model_dump and
        json.dumps hold the GIL for a whole call, and the event loop waits for the GIL."""
        response = self.response(num_choices, deltas, usage)
        choices = [choice.model_dump(mode="json") for choice in response.choices]
        rest = response.model_dump(mode="json", exclude={"choices"})
        data = {
            name: choices if name == "choices" else rest[name]
            for name in type(response).model_fields
        }
        return json_body(data if extra is None else {**data, **extra})

    def opening_chunks(self, num_choices: int) -> list[BaseModel]:
        return []

    def chunk(self, delta: ChoiceDelta) -> BaseModel | None:
        raise NotImplementedError

    def chunks(self, delta: ChoiceDelta) -> list[BaseModel]:
        """The stream chunks of one delta (none, one, or several)."""
        chunk = self.chunk(delta)
        return [] if chunk is None else [chunk]

    def has_prompt_logprobs(self, delta: ChoiceDelta) -> bool:
        """Whether chunks(delta) hold a whole prompt's logprobs (an echo), not only the
        delta's own tokens: prompt-sized, so worth building off the event loop."""
        return False

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
            whole.stop_string = delta.stop_string or whole.stop_string
            whole.prompt_logprobs = delta.prompt_logprobs or whole.prompt_logprobs
        return folded


# Levels of a response body whose size grows with the request: the body, its choices, a choice
# and its logprobs; json_body encodes them a part at a time.
_NUM_SPLIT_LEVELS = 4
_ITEMS_PER_CALL = 256  # of a long list below them: a token's logprob entry each


def json_body(data: dict[str, Any]) -> bytes:
    """A JSON response body, byte for byte as Starlette's JSONResponse renders one (its keys
    are strings). Compact JSON is the concatenation of its parts' JSON, so it is encoded a part
    at a time: json.dumps holds the GIL for a whole call, and the event loop waits for it."""
    return _encoded(data, _NUM_SPLIT_LEVELS).encode()


def _encoded(value: Any, num_levels: int) -> str:
    if num_levels > 0 and isinstance(value, dict):
        fields = (f"{_dumps(key)}:{_encoded(item, num_levels - 1)}" for key, item in value.items())
        return "{" + ",".join(fields) + "}"
    if num_levels > 0 and isinstance(value, list):
        return "[" + ",".join(_encoded(item, num_levels - 1) for item in value) + "]"
    if isinstance(value, list) and len(value) > _ITEMS_PER_CALL:
        step = _ITEMS_PER_CALL
        parts = (_dumps(value[i : i + step])[1:-1] for i in range(0, len(value), step))
        return "[" + ",".join(parts) + "]"
    return _dumps(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ChatFormatter(Formatter):
    def __init__(self, *, tool_calls: ToolCallMode | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tool_call_mode = tool_calls
        self._parsers: dict[int, ToolCallParser] = {}  # streaming: one per choice

    def response(
        self, num_choices: int, deltas: list[ChoiceDelta], usage: Usage
    ) -> ChatCompletionResponse:
        choices = [self._choice(whole) for whole in self.fold(num_choices, deltas)]
        return ChatCompletionResponse(**self.header, choices=choices, usage=usage)

    def _choice(self, whole: ChoiceDelta) -> ChatChoice:
        finish_reason = whole.finish_reason or "stop"
        if self.tool_call_mode is None:
            message = ChatResponseMessage(content=whole.text)
        else:
            parser = ToolCallParser(self.tool_call_mode)
            content = parser.feed(whole.text)
            rest, calls = parser.finish()
            content += rest
            tool_calls = [
                ResponseToolCall(
                    id=new_tool_call_id(),
                    function=ResponseFunctionCall(name=call.name, arguments=call.arguments),
                )
                for call in calls
            ]
            message = ChatResponseMessage(
                content=content or (None if calls else ""), tool_calls=tool_calls or None
            )
            finish_reason = _tool_finish_reason(finish_reason, calls)
        return ChatChoice(
            index=whole.index,
            message=message,
            logprobs=self._logprobs(whole),
            finish_reason=finish_reason,
        )

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

    def chunks(self, delta: ChoiceDelta) -> list[BaseModel]:
        """With tools: content as it becomes final; at the finish, each call as two deltas
        (id, type and name, then the arguments) and a last one with the finish reason."""
        if self.tool_call_mode is None:
            return super().chunks(delta)
        parser = self._parsers.setdefault(delta.index, ToolCallParser(self.tool_call_mode))
        content = parser.feed(delta.text)
        calls: list[ParsedCall] = []
        if delta.finish_reason is not None:
            rest, calls = parser.finish()
            content += rest
        chunks: list[BaseModel] = []
        if content or delta.token_ids:
            body = ChatChunkChoice(
                index=delta.index,
                delta={"content": content} if content else {},
                logprobs=self._logprobs(delta),
            )
            chunks.append(self._chunk([body]))
        for number, call in enumerate(calls):
            function = {"name": call.name, "arguments": ""}
            opening = {"index": number, "id": new_tool_call_id(), "type": "function"}
            arguments = {"index": number, "function": {"arguments": call.arguments}}
            for part in ({**opening, "function": function}, arguments):
                chunks.append(
                    self._chunk([ChatChunkChoice(index=delta.index, delta={"tool_calls": [part]})])
                )
        if delta.finish_reason is not None:
            reason = _tool_finish_reason(delta.finish_reason, calls)
            chunks.append(
                self._chunk([ChatChunkChoice(index=delta.index, delta={}, finish_reason=reason)])
            )
        return chunks

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(**self.header, choices=choices, usage=usage)

    def _logprobs(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(lp) for lp in delta.logprobs])

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self._token(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(raw))

    def _token_logprob(self, lp: TokenLogprob) -> ChatTokenLogprob:
        top = [self._top(token_id, logprob) for token_id, logprob in lp.top_logprobs]
        sampled = self._top(lp.token_id, lp.logprob)
        return ChatTokenLogprob(**sampled.model_dump(), top_logprobs=top)


def _tool_finish_reason(finish_reason: str, calls: list[ParsedCall]) -> str:
    """ "tool_calls" when the choice ended (not cut) having called tools, all whole."""
    is_whole = bool(calls) and all(call.is_complete for call in calls)
    return "tool_calls" if is_whole and finish_reason == "stop" else finish_reason


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
    """echo_prompts (one per prompt, with echo): each choice's text starts with its prompt;
    with logprobs, so do its logprobs (the first prompt token's are null, it has no logits
    before it) and completion offsets count from the start of the echoed text. Streamed, the
    echo is a choice's first chunk, sent with its first delta: the prompt's logprobs come
    with the first tokens (both need the prompt computed)."""

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
