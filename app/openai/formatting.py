"""What the OpenAI endpoints' formatters share: ChoiceDelta, the Formatter base and json_body.

Each endpoint's Formatter: app/openai/chat_format.py, app/openai/completion_format.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from app.openai.response_models import ChatCompletionResponse, CompletionResponse, Usage
from engine.core.protocol import TokenLogprob


@dataclass
class ChoiceDelta:
    """What one choice produced since its previous delta (plain data, app/serving/choices.py)."""

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
        """response() as a JSON body, `extra`'s fields after its own. Blocking (a second or
        more near max_logprob_entries): serving runs it off the loop.

        Dumped a choice at a time and encoded a part at a time (json_body), so the event loop
        gets the GIL between calls."""
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
    """A JSON response body (string keys), byte for byte as Starlette's JSONResponse renders it.

    Encoded a part at a time (compact JSON is its parts' JSON joined): one json.dumps call holds
    the GIL throughout, and the event loop waits for it."""
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
