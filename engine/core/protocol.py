"""The message boundary between app/ and engine/: plain dataclasses, no tensors."""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.sampling_params import SamplingParams

MIN_PRIORITY = -1_000_000  # the `priority` extension field's bounds (vLLM: lower runs first)
MAX_PRIORITY = 1_000_000


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the client went away or the server aborted it
    ERROR = "error"  # an engine fault touched this request


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine sees it: token ids in, never text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # Narrows the prefix-cache namespace (tenant / cache_salt); None shares the model's root.
    cache_salt: str | None = None
    # Fair share: the tenant whose service this is (None: the one shared tenant) and the
    # priority within it (lower runs first, within MIN_PRIORITY..MAX_PRIORITY).
    tenant: str | None = None
    priority: int = 0
    # The prompt's first tokens hold text the client changes per request or session (an
    # agent's billing line): a miss inside them is classified volatile_prefix.
    num_volatile_prefix_tokens: int = 0


@dataclass(frozen=True)
class AdmittedRequest:
    """A request the engine has checked against its model, with its compiled grammar (None
    without structured output): what generate() runs. Only an engine's admit() makes one, so
    a request is checked once and compiled once."""

    request: EngineRequest
    grammar: Any = None


@dataclass
class TokenLogprob:
    """The sampled token's logprob (log-softmax of the raw logits) and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """What one choice produced since the previous RequestOutput (a delta)."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the choice, when one did.
    stop_token_id: int | None = None


# engine/kv/cache_diagnosis.py: MissReason, in the order the reasons are decided.
CACHE_MISS_REASONS = (
    "not_cacheable",
    "full_hit",
    "quarantined",
    "evicted",
    "below_block",
    "volatile_prefix",
    "other_namespace",
    "no_earlier_prefix",
    "diverged",
)


@dataclass(frozen=True)
class CacheDiagnosis:
    """Why a request's prompt missed the prefix cache, decided at its first admission
    (engine/kv/cache_diagnosis.py names the reasons). Token indices are into the prompt."""

    num_prompt_tokens: int
    num_matched_tokens: int  # served from the cache (usage.prompt_tokens_details.cached_tokens)
    block_size: int
    first_miss_index: int | None  # the first prompt token not served; None on a full hit
    reason: str


@dataclass
class RequestOutput:
    """A delta for one request. `finished` is True once every choice has a finish_reason."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    # Prompt tokens whose KV this request added to the prefix cache so far (the blocks the tree
    # took from it, not those it already held): Anthropic's cache_creation_input_tokens.
    num_stored_prompt_tokens: int = 0
    error: str | None = None
    # sampling_params.prompt_logprobs: prompt tokens 1.. (the first has no logits before
    # it), once, in the first delta after the whole prompt was scored (with its first tokens).
    prompt_logprobs: list[TokenLogprob] | None = None
    # Set once the request was first admitted (every delta from then on carries it). Left out
    # of ==: it describes the cache's state, not what the request produced.
    cache_diagnosis: CacheDiagnosis | None = field(default=None, compare=False)


@dataclass(frozen=True)
class StepSample:
    """One engine step, for the step-duration and batch-size histograms."""

    duration_s: float
    num_seqs: int
    num_tokens: int


@dataclass(frozen=True)
class EngineStats:
    """An immutable snapshot of the engine in plain numbers; app/metrics.py turns it into
    Prometheus. The engine thread publishes one after every step (LLMEngine.latest_stats);
    readers keep the latest and never call into the engine for figures.
    """

    num_running: int = 0
    num_waiting: int = 0
    # KV blocks by state; they add up to num_total_blocks.
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    num_private_blocks: int = 0  # refcount 1, not in the prefix tree
    num_shared_blocks: int = 0  # refcount > 1
    num_cached_blocks: int = 0  # held only by the prefix tree (evictable)
    block_size: int = 16
    bytes_per_block: int = 0
    kv_usage_watermark: float = 0.0  # peak used fraction since start
    kv_fragmentation_ratio: float = 0.0  # unused slots in allocated blocks / allocated slots
    num_leaked_blocks: int = 0
    fair_share_counter_spread: float = 0.0  # max - min of the tenants' virtual token counters
    # Monotonic counters.
    num_preemptions: int = 0
    num_lookahead_steps: int = 0  # decode steps scheduled while the one before ran
    num_prompt_tokens: int = 0
    num_prefill_tokens: int = 0  # actually computed
    num_generation_tokens: int = 0
    num_cow_copies: int = 0
    num_evictions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    # Prompt tokens not served from the cache, by miss reason: ((reason, tokens), ...), sorted.
    prefix_cache_miss_tokens: tuple[tuple[str, int], ...] = ()
    num_audits: int = 0
    num_audit_corruptions: int = 0
    num_audit_drifts: int = 0
    num_audits_dropped: int = 0
    num_quarantined_blocks: int = 0
    num_write_violations: int = 0  # slot mappings that targeted a shared / cached block
    num_spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_spec_accepted_tokens: int = 0  # of those, kept (the target chose the same token)
    # Second KV tier (kv_tier "" when off). Tokens of first admissions served from it are
    # prefix_cache_tier_hits (counted in prefix_cache_hits too); restore audits are audits of
    # hits that loaded from it (counted in num_audits too).
    kv_tier: str = ""
    kv_tier_bytes: int = 0
    kv_tier_entries: int = 0
    prefix_cache_tier_hits: int = 0
    num_tier_stored_blocks: int = 0
    num_tier_loaded_blocks: int = 0
    num_tier_checksum_failures: int = 0
    num_tier_refused_entries: int = 0  # another fingerprint, namespace or token path
    num_tier_missing_entries: int = 0
    num_tier_dropped_entries: int = 0  # for room
    num_tier_restored_at_start: int = 0
    num_tier_ignored_at_start: int = 0
    num_tier_spills_lost: int = 0
    num_tier_invalidated_entries: int = 0  # dropped with a quarantined block
    num_tier_write_errors: int = 0  # entries the store could not write (a full disk)
    num_restore_audits: int = 0
    num_restore_audit_corruptions: int = 0
    tier_load_seconds: tuple[float, ...] = ()  # loads since the previous snapshot
    num_kv_events_published: int = 0  # KV cache events sent (kv_events_endpoint set)
    num_kv_events_dropped: int = 0  # KV cache events dropped: the publisher's queue was full
    # What the step that published this snapshot did: each snapshot is delivered once, so a
    # reader histograms these without double counting.
    num_steps: int = 0  # model steps so far (a sequence number)
    step: StepSample | None = None  # None when no model step ran (idle, or a failed step)
    audit_max_abs_diffs: tuple[float, ...] = ()  # audits that finished in that step
    # Structured output (response_format). Counters: constrained requests queued, by kind;
    # compiles answered from the grammar cache (or joined in flight); compiles that failed or
    # timed out. Since the previous snapshot: the seconds of each compile that finished (off
    # the engine thread), and the host seconds grammar masks added to the steps.
    num_structured_json_object_requests: int = 0
    num_structured_json_schema_requests: int = 0
    num_structured_tool_calls_requests: int = 0  # tool_choice auto (required/named: json_schema)
    num_grammar_cache_hits: int = 0
    num_grammar_compile_failures: int = 0
    grammar_compile_seconds: tuple[float, ...] = ()
    grammar_mask_seconds: float = 0.0


# The drills of engine/audit/faults.py (the pool) and engine/audit/tier_faults.py (the tier).
FAULT_KINDS = (
    "corrupt_block",
    "wrong_block",
    "tier_bit_flip",
    "tier_truncate",
    "tier_foreign_namespace",
    "tier_foreign_model",
)


@dataclass(frozen=True)
class FaultReport:
    """What a fault-injection drill did (POST /debug/faults; off unless enabled)."""

    kind: str  # corrupt_block | wrong_block
    block_ids: list[int]  # the blocks it touched
    detail: str


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to know about the served model."""

    name: str  # the id served in /v1/models and accepted in requests
    tokenizer_path: str  # a directory AutoTokenizer / tokenizers can read offline
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    weights_version: str  # changes when other weights load; part of the cache namespace


class EngineClient(Protocol):
    """What app/ uses of the engine. Implemented by AsyncEngine (and fakes in tests).

    admit() checks a request and compiles its grammar; generate() runs what it admitted and
    yields deltas until one with finished=True; if the consumer stops iterating
    (client disconnect) the implementation aborts the request and frees its blocks.
    """

    async def start(self) -> None:
        """Begin loading the model in the background; returns at once (is_ready tells when)."""
        ...

    @property
    def model_info(self) -> ModelInfo:
        """The served model; only valid once is_ready is True."""
        ...

    def admit(self, request: EngineRequest, prompt_param: str = "prompt") -> AdmittedRequest:
        """Check `request` against the model (ParamError names the bad field; `prompt_param`
        the prompt's) and compile its grammar: the one check and the one compile a request
        gets. Blocking (a compile): call it from a worker thread. EngineNotReady before the
        model is loaded."""
        ...

    def generate(self, admitted: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        """Run an admitted request; raises DuplicateRequest for an id that is still running."""
        ...

    async def abort(self, request_id: str, choice_index: int | None = None) -> None:
        """Abort a whole request, or only one of its choices (a stop string ended it)."""
        ...

    def stats(self) -> EngineStats:
        """The latest snapshot the engine published (no call into the engine thread)."""
        ...

    def add_stats_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """listener(snapshot) runs on the event loop once for every snapshot the engine
        publishes (one per step), in order."""
        ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def load_error(self) -> str | None:
        """Why loading failed, if it did: the exception's type and message (the server then
        stops: `kvshare serve` exits with status 3)."""
        ...

    async def shutdown(self) -> None: ...

    async def kv_block_hashes(self) -> list[int]:
        """The hashes of every block the prefix cache holds, sorted, as the KV events name
        them (GET /debug/kv_blocks). Raises KVEventsDisabled unless KV events are on."""
        ...

    async def inject_fault(
        self, kind: str, block_id: int | None = None, other_block_id: int | None = None
    ) -> FaultReport:
        """Drills only: damage the prefix cache between two steps (see engine/audit/auditor.py).

        Raises FaultInjectionDisabled unless the engine was configured with
        enable_fault_injection, UnknownFaultKind for an unknown kind, InvalidFaultTarget for a
        target the cache does not hold, EngineNotReady when the engine is not running
        (engine/core/errors.py).
        """
        ...
