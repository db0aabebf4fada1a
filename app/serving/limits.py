"""Caps on what one request may make the server do, from the server settings.

Each cap is a `server:` settings key (config/default.yaml); a request over one is refused with
a ParamError (a 400) naming the field, before anything is tokenized or queued. The ranges that
never change (temperature 0..2, ...) are declared on the fields in
app/openai/request_models.py instead.
The schema size cap is the engine's own key, max_schema_bytes, checked here too so that the
400 comes before any schema work and names the field the schema came in; so is max_num_seqs,
which bounds `n` (a prompt's choices run as one batch).
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass, fields

from app.openai.request_models import ChatCompletionRequest, CompletionRequest
from app.settings import ServerSettings
from engine.core.config import EngineConfig
from engine.core.errors import ParamError


@dataclass(frozen=True)
class RequestLimits:
    """The caps (each one is documented where ServerSettings' defaults live: default.yaml)."""

    max_n: int
    max_output_tokens: int
    max_prompts: int
    max_messages: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_logit_bias_entries: int
    max_stop_token_ids: int
    max_logprob_entries: int
    max_top_logprobs: int
    max_tools: int
    max_schema_bytes: int
    max_num_seqs: int

    @classmethod
    def of(cls, server: ServerSettings, engine: EngineConfig | None = None) -> RequestLimits:
        """The server's caps, and the engine's two (its defaults if engine is None)."""
        engine = engine if engine is not None else EngineConfig()
        engine_keys = ("max_schema_bytes", "max_num_seqs")
        names = [field.name for field in fields(cls) if field.name not in engine_keys]
        caps = {name: getattr(server, name) for name in names}  # same names as the settings
        return cls(**caps, **{name: getattr(engine, name) for name in engine_keys})

    def check_chat(self, request: ChatCompletionRequest) -> None:
        """ParamError naming the first chat field over its cap."""
        self._check_sampling(request)
        _at_most(request.messages, self.max_messages, "messages", "messages")
        _at_most(request.tools or [], self.max_tools, "tools", "tools")
        self._check_value(request.top_logprobs, self.max_top_logprobs, "top_logprobs")
        self._check_value(
            request.max_completion_tokens, self.max_output_tokens, "max_completion_tokens"
        )
        # The engine compiles all tools' parameters into one grammar: their sum is capped too.
        num_bytes = sum(
            self._check_schema(text, f"tools[{number}].function.parameters")
            for number, text in enumerate(request.tool_schema_texts)
        )
        if num_bytes > self.max_schema_bytes:
            message = (
                f"tools hold {num_bytes} bytes of parameter schemas in all; the limit is "
                f"{self.max_schema_bytes} (max_schema_bytes)"
            )
            raise ParamError("tools", message)

    def check_completion(self, request: CompletionRequest) -> None:
        """ParamError naming the first completions field over its cap."""
        self._check_sampling(request)
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            _at_most(prompt, self.max_prompts, "prompt", "prompts")
        self._check_value(request.logprobs, self.max_top_logprobs, "logprobs")

    def _check_sampling(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        self._check_value(request.n, self.max_n, "n")
        if request.n is not None and request.n > self.max_num_seqs:
            message = f"n is {request.n}; the limit is {self.max_num_seqs} (max_num_seqs)"
            raise ParamError("n", message)
        self._check_value(request.max_tokens, self.max_output_tokens, "max_tokens")
        stops = request.stop_strings
        _at_most(stops, self.max_stop_strings, "stop", "stop strings")
        for number, stop in enumerate(stops):
            if len(stop) > self.max_stop_string_chars:
                where = "stop" if isinstance(request.stop, str) else f"stop[{number}]"
                message = (
                    f"{where} is {len(stop)} characters long; the limit is "
                    f"{self.max_stop_string_chars} (max_stop_string_chars)"
                )
                raise ParamError("stop", message)
        bias = request.logit_bias or {}
        _at_most(bias, self.max_logit_bias_entries, "logit_bias", "entries")
        stop_ids = request.stop_token_ids or []
        _at_most(stop_ids, self.max_stop_token_ids, "stop_token_ids", "token ids")
        self._check_schema(request.response_schema_text, "response_format")

    def check_logprob_entries(self, num_entries: int, param: str) -> None:
        """ParamError naming `param` when a response would carry more token logprobs than
        max_logprob_entries (num_entries: choices x tokens x (top logprobs + 1))."""
        if num_entries > self.max_logprob_entries:
            message = (
                f"{param}: the response would carry {num_entries} token logprobs (choices x "
                f"tokens x (top logprobs + 1)); the limit is {self.max_logprob_entries} "
                "(max_logprob_entries)"
            )
            raise ParamError(param, message)

    @staticmethod
    def _check_value(value: int | None, limit: int, param: str) -> None:
        if value is not None and value > limit:
            key = _KEYS[param]
            raise ParamError(param, f"{param} is {value}; the limit is {limit} ({key})")

    def _check_schema(self, text: str | None, param: str) -> int:
        """The size of a schema's canonical JSON `text` (the request's, which the engine
        measures too); ParamError over max_schema_bytes."""
        if text is None:
            return 0
        num_bytes = len(text.encode())
        if num_bytes > self.max_schema_bytes:
            message = (
                f"{param} holds a schema of {num_bytes} bytes of JSON; the limit is "
                f"{self.max_schema_bytes} (max_schema_bytes)"
            )
            raise ParamError(param, message)
        return num_bytes


# The field a cap applies to -> the settings key that sets it (named in every refusal).
_KEYS = {
    "n": "max_n",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "top_logprobs": "max_top_logprobs",
    "logprobs": "max_top_logprobs",
    "prompt": "max_prompts",
    "messages": "max_messages",
    "stop": "max_stop_strings",
    "logit_bias": "max_logit_bias_entries",
    "stop_token_ids": "max_stop_token_ids",
    "tools": "max_tools",
}


def _at_most(items: Sized, limit: int, param: str, what: str) -> None:
    if len(items) > limit:
        message = f"{param} has {len(items)} {what}; the limit is {limit} ({_KEYS[param]})"
        raise ParamError(param, message)
