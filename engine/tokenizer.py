"""Tokenizer, chat template and incremental detokenizer with stop strings (torch-free).

Reads a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json, optionally
chat_template.jinja and generation_config.json) with the `tokenizers` library and jinja2 only:
transformers is never imported here, because it may pull in torch. The template's Jinja
environment and the generic tool format live in engine/chat_template.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from engine.chat_template import (
    FAMILY_TEMPLATES,
    compile_template,
    generic_tool_messages,
    reads_tools,
)
from engine.core.errors import KVShareError

# vLLM's trick: decode a few prompt tokens as context so that the first generated token
# gets its leading space right with SentencePiece-style tokenizers.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
_LONG_TEXT_CHARS = 16 * 1024  # above this, encode() lets other threads run (see there)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ChatTemplateError(KVShareError):
    """The chat template refused the conversation (raise_exception) or is missing/broken."""


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode alphabet for bytes, reversed: char -> byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _uses_byte_level(decoder: Mapping[str, Any] | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders", []) or [])


class Tokenizer:
    """A tokenizer directory: encode/decode, chat template, special tokens.

    Thread-safe for concurrent encode/decode (the Rust tokenizer is immutable here).
    `chat_template` (Jinja source) replaces the directory's own template when given.
    """

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        self.path = Path(path)
        self._tokenizer = _HFTokenizer.from_file(str(self.path / "tokenizer.json"))
        self._config = _read_json(self.path / "tokenizer_config.json")
        raw = _read_json(self.path / "tokenizer.json")
        self._byte_decoder = _byte_level_decoder() if _uses_byte_level(raw.get("decoder")) else None
        self.chat_template = chat_template or self._load_chat_template()
        self.special_tokens = self._load_special_tokens()
        self.eos_token_ids = self._load_eos_token_ids()

    # -- loading --------------------------------------------------------------------------

    def _load_chat_template(self) -> str | None:
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            return named.get("default") or next(iter(named.values()), None)
        if template is None:  # the family's documented format, where kvshare knows one
            model_type = _read_json(self.path / "config.json").get("model_type")
            template = FAMILY_TEMPLATES.get(model_type)
        return template

    def _load_special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad token strings, as transformers passes them to chat templates."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        found = {name: _token_content(self._config.get(name)) for name in names}
        return {name: value for name, value in found.items() if value is not None}

    def _load_eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := self._tokenizer.token_to_id(eos)) is not None:
            ids.append(eos_id)
        generation = _read_json(self.path / "generation_config.json").get("eos_token_id")
        for token_id in generation if isinstance(generation, list) else [generation]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
        return tuple(ids)

    # -- vocabulary -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes one token stands for (may be part of a multi-byte char)."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_token_ids:  # added tokens are stored as plain text
            return piece.encode()
        if self._byte_decoder is not None:
            if all(char in self._byte_decoder for char in piece):
                return bytes(self._byte_decoder[char] for char in piece)
            return piece.encode()
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode()

    def token_text(self, token_id: int) -> str:
        """A token as text for logprobs; a partial UTF-8 char shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    # -- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _LONG_TEXT_CHARS:
            # encode_batch releases the GIL (encode holds it: ~1 s per MiB), so a long prompt
            # tokenized in a worker thread leaves the server's event loop free meanwhile.
            batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
            return batch[0].ids
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError(f"the tokenizer in {self.path} has no chat template")
        try:
            return compile_template(self.chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e

    @cached_property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (Qwen2/3, Llama 3 do)."""
        return reads_tools(self.chat_template or "")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of `messages` (keys with None dropped).

        continue_final_message: the text ends right after the last message's content, so that
        the closing tokens the template writes after it are cut and generation continues that
        message (transformers does the same: it cuts at the last occurrence of the content).
        tools (OpenAI's shape): given to a template that reads them; otherwise the messages
        are rewritten into the generic tool format (generic_tool_messages). Without tools the
        messages reach the template as they are (it may refuse a tool role).
        """
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        template_tools = list(tools) if tools else None
        if template_tools and not self.template_takes_tools:
            plain, template_tools = generic_tool_messages(plain, template_tools), None
        try:
            text = self._compiled_template.render(
                messages=plain,
                tools=template_tools,
                documents=None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        return _open_final_message(text, plain[-1]) if continue_final_message else text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation.

        The template already writes every special token it wants (BOS included), so the text
        is encoded without adding special tokens again, as transformers does.
        """
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, tools)
        return self.encode(text, False)


def _open_final_message(text: str, final_message: Mapping[str, Any]) -> str:
    """`text` cut right after the final message's (stripped) content."""
    content = final_message.get("content")
    content = content.strip() if isinstance(content, str) else ""
    if not content:
        raise ChatTemplateError("continue_final_message needs a final message with content")
    end = text.rfind(content)
    if end == -1:
        raise ChatTemplateError("the chat template does not write the final message's content")
    return text[: end + len(content)]


class IncrementalDetokenizer:
    """Turns one choice's token ids into text deltas, token by token.

    Contract:
      - feed() returns only text that is final: never a partial UTF-8 char (held while the
        decoded tail ends in U+FFFD) and never text that could still grow into a stop string.
      - When a stop string appears, the output is cut right before it (right after it with
        include_stop), `stop_string` names it and every later feed() returns "". The caller
        should stop the choice.
      - finish() flushes the held text when the choice ends for another reason.
    Decoding is incremental: each token decodes a short window [prefix_offset:] of ids, so
    the work per token does not grow with the output length.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop
        self._token_ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._held = ""  # decoded text that might still start a stop string
        self._released: list[str] = []
        self._num_released_chars = 0
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        return "".join(self._released)

    @property
    def num_decoded_chars(self) -> int:
        """Characters decoded so far (released + held): the offset of the next token's text."""
        return self._num_released_chars + len(self._held)

    @property
    def is_stopped(self) -> bool:
        return self.stop_string is not None

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add generated token ids; return the newly final text (may be "")."""
        pieces = [self.feed_token(token_id) for token_id in token_ids]
        return "".join(pieces)

    def feed_token(self, token_id: int) -> str:
        if self.is_stopped:
            return ""
        self._token_ids.append(token_id)
        return self._accept(self._decode_new_text(final=False), final=False)

    def finish(self) -> str:
        """The choice ended: release everything still held.

        Bytes of a multi-byte character that the output cut off (max_tokens reached mid-
        character) cannot become text: they are dropped rather than shown as U+FFFD.
        """
        if self.is_stopped:
            return ""
        return self._accept(self._decode_new_text(final=True).rstrip(_REPLACEMENT_CHAR), True)

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._token_ids[start:end]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self, final: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text) or (
            full_text.endswith(_REPLACEMENT_CHAR) and not final
        ):
            return ""  # nothing new yet, or a multi-byte char still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text) :]

    def _accept(self, new_text: str, final: bool) -> str:
        """Append decoded text; cut at the earliest stop string; hold what may still become one.

        A complete match waits while a stop string that would start earlier can still
        complete (stops "baa" and "a" on "ba|a" must cut at 0, not 1).
        """
        self._held += new_text
        match, stop = self._earliest_match()
        open_start = None if final else self._earliest_open_start()
        if match is not None and (open_start is None or match <= open_start):
            self.stop_string = stop
            end = match + len(stop) if self._include_stop and stop is not None else match
            return self._release(self._held[:end], keep="")
        split = len(self._held) if open_start is None else open_start
        return self._release(self._held[:split], keep=self._held[split:])

    def _earliest_match(self) -> tuple[int | None, str | None]:
        best: tuple[int | None, str | None] = (None, None)
        for stop in self._stop:
            position = self._held.find(stop)
            if position != -1 and (best[0] is None or position < best[0]):
                best = (position, stop)
        return best

    def _earliest_open_start(self) -> int | None:
        """First position whose tail of the held text is a proper prefix of a stop string."""
        if not self._stop:
            return None
        longest = max(len(stop) for stop in self._stop)
        for start in range(max(0, len(self._held) - longest + 1), len(self._held)):
            tail = self._held[start:]
            if any(len(tail) < len(stop) and stop.startswith(tail) for stop in self._stop):
                return start
        return None

    def _release(self, text: str, keep: str) -> str:
        self._held = keep
        if text:
            self._released.append(text)
            self._num_released_chars += len(text)
        return text
