"""The chat completions formatter: ChoiceDeltas -> a ChatCompletionResponse or its chunks,
tool calls included."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel

from app.openai.formatting import ChoiceDelta, Formatter
from app.openai.response_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ResponseFunctionCall,
    ResponseToolCall,
    TopLogprob,
    Usage,
)
from app.openai.tool_calls import ParsedCall, ToolCallMode, ToolCallParser
from engine.core.protocol import TokenLogprob


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
