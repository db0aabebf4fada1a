"""Grammar-constrained decoding with xgrammar: compiled grammars (off the engine thread,
bounded in time and size, cached) and the per-choice matchers whose masks the sampler applies.

Two owners, two threads:

- GrammarCache (thread-safe): StructuredOutput -> xgrammar CompiledGrammar. Compiles run in
  killable child processes, two at once and one per tenant (grammar_compiles.py), and are
  awaited with a time limit; a bad schema, a failure or a time-out raises
  ParamError("response_format") for that request only. AsyncEngine calls compile_for() from
  a worker thread before it queues a request, so the engine thread never compiles;
  LLMEngine.add_request (the offline edge) calls it synchronously. Identical constraints
  share one compile (the cache holds futures, in flight or done) and a cache hit costs a
  dict look-up. Entries are kept per cache namespace (the request's cache_salt: tenant and
  salt), so one tenant's compile is never another's hit: neither the time a hit saves nor
  the hit counter tells a tenant whether anyone else used a schema.
- GrammarMatchers (engine thread only): request id -> its compiled grammar and one
  GrammarMatcher per choice, keyed (request_id, choice_index) as SampleSpec.grammar_keys
  names them. A matcher is never reset or replayed: it remembers how many output tokens it
  has accepted and, before each mask, accepts the ones it has not seen yet
  (SampleSpec.output_token_ids only grows, also across a preemption by recompute, which keeps
  the outputs). Requests the scheduler reports finished (SchedulerOutput.finished_request_ids)
  are released.

The tokenizer's vocabulary is given the model's vocab_size: ids the tokenizer does not have
(padding) are never allowed, nor are special tokens other than the stop tokens (the model's
eos_token_ids), which the mask allows exactly when the grammar accepts the text so far.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from engine.core.config import EngineConfig
from engine.core.errors import ParamError
from engine.core.protocol import ModelInfo
from engine.core.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutput
from engine.runtime.grammar_compiles import (
    Compiled,
    CompileFailed,
    CompileTimeout,
    GrammarCompiles,
    shared_compiles,
)

logger = logging.getLogger(__name__)

_GRACE_S = 1.0  # past a compile's limit, how long a waiter lets the host report the kill
_ANY_JSON_OBJECT = '{"type":"object"}'

GrammarKey = tuple[str, int]  # (request_id, choice_index)
_Key = tuple[str | None, StructuredOutput]  # (cache namespace, constraint): one cache entry


def check_structured_params(params: SamplingParams) -> None:
    """ParamError for sampling fields a grammar cannot honour (called before compiling)."""
    if params.structured is None:
        return
    if params.ignore_eos:
        raise ParamError(
            "ignore_eos", "ignore_eos cannot be combined with response_format (a grammar ends "
            "the output with EOS once the JSON is complete)",
        )  # fmt: skip
    if params.min_tokens > 0:
        raise ParamError(
            "min_tokens", "min_tokens cannot be combined with response_format (the grammar "
            "decides when the output may end)",
        )  # fmt: skip


class GrammarCache:
    """StructuredOutput -> CompiledGrammar, compiled in killable children, LRU-bounded.

    Thread-safe: any thread may call compile_for(); the engine thread reads the counters
    (num_cache_hits, num_compile_failures, drain_compile_seconds()) for its snapshot. The
    tokenizer's xgrammar view is built on first use, in the calling thread, outside the
    compile time limit, and so is the compile host if it is not running yet.
    """

    def __init__(
        self,
        model_info: ModelInfo,
        config: EngineConfig,
        compiles: GrammarCompiles | None = None,
    ) -> None:
        self.model_info = model_info
        self.timeout_s = config.grammar_compile_timeout_seconds
        self.max_schema_bytes = config.max_schema_bytes
        self.max_entries = config.grammar_cache_size
        self._compiles = compiles if compiles is not None else shared_compiles()
        self._lock = threading.Lock()
        self._tokenizer_id: int | None = None
        self._entries: OrderedDict[_Key, Future[Compiled]] = OrderedDict()
        self.num_cache_hits = 0
        self.num_compile_failures = 0  # grammar errors and time-outs
        self._compile_seconds: list[float] = []

    def compile_for(
        self, params: SamplingParams, namespace: str | None = None, tenant: str | None = None
    ) -> xgr.CompiledGrammar | None:
        """The compiled grammar of params.structured (None without one) for the cache
        namespace `namespace` (a request's cache_salt), compiled in `tenant`'s turn; blocks
        up to the time limit. Raises ParamError naming the field for anything this request
        cannot get."""
        check_structured_params(params)
        if params.structured is None:
            return None
        return self.compile(params.structured, namespace, tenant)

    def compile(
        self,
        structured: StructuredOutput,
        namespace: str | None = None,
        tenant: str | None = None,
    ) -> xgr.CompiledGrammar:
        schema = structured.schema if structured.schema is not None else _ANY_JSON_OBJECT
        num_bytes = len(schema.encode())
        where = structured.param
        if num_bytes > self.max_schema_bytes:
            raise ParamError(
                where,
                f"{where} schema is {num_bytes} bytes; the limit is "
                f"{self.max_schema_bytes} (max_schema_bytes)",
            )
        tokenizer_id = self._get_tokenizer_id()
        deadline = time.monotonic() + self.timeout_s
        future = self._future((namespace, structured), tokenizer_id, tenant)
        try:
            compiled, _ = future.result(timeout=deadline - time.monotonic() + _GRACE_S)
            return compiled
        except (FutureTimeout, CompileTimeout):
            self._compiles.give_up(future)
            self._count_failure()
            raise ParamError(
                where,
                f"compiling {where} into a grammar took longer than {self.timeout_s:g} s "
                "(grammar_compile_timeout_seconds); simplify the schema",
            ) from None
        except CompileFailed as exc:  # xgrammar's error for a schema it cannot compile
            self._count_failure()
            message = f"{where} cannot be compiled into a grammar: {compile_error_text(exc)}"
            raise ParamError(where, message) from exc

    def drain_compile_seconds(self) -> list[float]:
        """Durations of the compiles that finished since the last call."""
        with self._lock:
            seconds, self._compile_seconds = self._compile_seconds, []
        return seconds

    def close(self) -> None:
        with self._lock:
            tokenizer_id, self._tokenizer_id = self._tokenizer_id, None
        if tokenizer_id is not None:
            self._compiles.forget(tokenizer_id)

    # -- internals ---------------------------------------------------------------------
    def _future(self, key: _Key, tokenizer_id: int, tenant: str | None) -> Future[Compiled]:
        """The cached (or in-flight) compile of key's constraint in key's namespace, else a
        newly submitted one (submitted outside the lock: a future's callbacks take it)."""
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.num_cache_hits += 1
                return future
        kind, text = grammar_source(key[1])
        submitted = self._compiles.submit(tokenizer_id, tenant, kind, text, self.timeout_s)
        with self._lock:
            future = self._entries.setdefault(key, submitted)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)  # the least recently used
        if future is not submitted:  # another thread submitted the same one meanwhile
            self._compiles.give_up(submitted)
            return future
        future.add_done_callback(lambda done: self._on_done(key, done))
        return future

    def _on_done(self, key: _Key, future: Future[Compiled]) -> None:
        """A compile that raised is not cached: the next request with it tries again."""
        with self._lock:
            if future.cancelled() or future.exception() is not None:
                if self._entries.get(key) is future:
                    del self._entries[key]
            else:
                self._compile_seconds.append(future.result()[1])

    def _count_failure(self) -> None:
        with self._lock:
            self.num_compile_failures += 1

    def _get_tokenizer_id(self) -> int:
        with self._lock:
            if self._tokenizer_id is None:
                try:
                    info = tokenizer_info(self.model_info)
                except Exception as exc:  # no tokenizer next to the weights, or unreadable
                    raise ParamError(
                        "response_format",
                        f"response_format needs the model's tokenizer, which cannot be read "
                        f"from {self.model_info.tokenizer_path}: {exc}",
                    ) from exc
                self._tokenizer_id = self._compiles.register(info)
            return self._tokenizer_id


def grammar_source(structured: StructuredOutput) -> tuple[str, str]:
    """(kind, text) of the grammar a constraint compiles from: a structural tag for
    "tool_calls", else a JSON schema (any JSON object without one)."""
    if structured.kind == "tool_calls":
        return "structural_tag", tool_calls_tag(structured.schema)
    schema = structured.schema if structured.schema is not None else _ANY_JSON_OBJECT
    return "json_schema", schema


TOOL_CALL_BEGIN = "<tool_call>"
# xgrammar's messages start with "[HH:MM:SS] /path/to/source.cc:LINE: ": not the client's business.
_SOURCE_PREFIX = re.compile(r"^\s*(\[[^\]]*\]\s*)?[^\s:]+\.(cc|cpp|h|hpp|py):\d+:\s*")


def compile_error_text(exc: BaseException) -> str:
    """What a client may read of a compile error: its first line, without the source location
    of the library that raised it."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return _SOURCE_PREFIX.sub("", lines[0]).strip() or "the grammar engine refused the schema"


def tool_calls_tag(tools_json: str) -> str:
    """The xgrammar structural tag of a "tool_calls" constraint (see StructuredOutput): text
    is free until `<tool_call>`; from there the call must be completed, as
    `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` with ARGS conforming to
    NAME's parameters. The trigger is a prefix of every tag's begin, as xgrammar requires."""
    tags = [
        {
            "type": "tag",
            "begin": f'{TOOL_CALL_BEGIN}\n{{"name": {json.dumps(tool["name"])}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": tool["parameters"],
                "max_whitespace_cnt": 1,  # bounded whitespace, so a call terminates
            },
            "end": "}\n</tool_call>",
        }
        for tool in json.loads(tools_json)
    ]
    tag = {"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN], "tags": tags}
    return json.dumps({"type": "structural_tag", "format": tag})


def tokenizer_info(model_info: ModelInfo) -> xgr.TokenizerInfo:
    """xgrammar's view of the served tokenizer: the model's vocab_size (ids past the
    tokenizer's are padding, never allowed), the model's EOS ids as stop tokens, and every
    other special token blanked so no grammar ever spells text with one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_info.tokenizer_path)
    vocab_size = model_info.vocab_size
    stop_token_ids = list(model_info.eos_token_ids)
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
    )
    special_ids = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and (token_id not in special_ids or token_id in stop_token_ids):
            encoded[token_id] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


@dataclass
class _ChoiceMatcher:
    matcher: xgr.GrammarMatcher
    num_accepted_tokens: int = 0


@dataclass
class _RequestGrammar:
    compiled: xgr.CompiledGrammar
    choices: dict[int, _ChoiceMatcher] = field(default_factory=dict)


class GrammarMatchers:
    """Per-choice matchers of the live constrained requests (engine thread only).

    register() when a request is queued, release() when the scheduler reports it finished;
    apply_masks() is what the sampler calls. Counters for the snapshot: num_requests_by_kind
    (monotonic) and take_mask_seconds() (host seconds spent on masks since the last call).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._requests: dict[str, _RequestGrammar] = {}
        self.num_requests_by_kind = dict.fromkeys(STRUCTURED_KINDS, 0)
        self._mask_seconds = 0.0

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    def register(self, request_id: str, kind: str, compiled: xgr.CompiledGrammar) -> None:
        assert request_id not in self._requests, f"grammar of {request_id} registered twice"
        self._requests[request_id] = _RequestGrammar(compiled)
        self.num_requests_by_kind[kind] += 1

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop the grammars and matchers of finished requests (unknown ids are ignored)."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def apply_masks(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        keys: Sequence[GrammarKey],
        histories: Sequence[Sequence[int]],
    ) -> None:
        """logits [N, V] in place: row rows[i] keeps only what keys[i]'s grammar allows after
        histories[i] (that choice's output tokens); other rows are untouched."""
        started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)  # [N, V/32]
        for row, key, history in zip(rows, keys, histories, strict=True):
            self._caught_up(key, history).fill_next_token_bitmask(bitmask, row)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=list(rows)
        )
        self._mask_seconds += time.perf_counter() - started

    def take_mask_seconds(self) -> float:
        seconds, self._mask_seconds = self._mask_seconds, 0.0
        return seconds

    def _caught_up(self, key: GrammarKey, history: Sequence[int]) -> xgr.GrammarMatcher:
        """key's matcher after accepting every token of history it has not seen yet."""
        request_id, choice_index = key
        request = self._requests.get(request_id)
        if request is None:
            raise RuntimeError(f"no grammar registered for request {request_id}")
        choice = request.choices.get(choice_index)
        if choice is None:
            choice = request.choices[choice_index] = _ChoiceMatcher(
                xgr.GrammarMatcher(request.compiled)
            )
        assert choice.num_accepted_tokens <= len(history), f"{key}: output tokens shrank"
        for token_id in history[choice.num_accepted_tokens :]:
            if not choice.matcher.accept_token(token_id):
                raise RuntimeError(f"{key}: the grammar rejected sampled token {token_id}")
            choice.num_accepted_tokens += 1
        return choice.matcher


def schema_text(value: dict) -> str:
    """A schema as the compact text StructuredOutput carries, keys in the order written."""
    return json.dumps(value, separators=(",", ":"))
