"""Per-sequence and per-request state kept by the scheduler (torch-free).

A sequence is one choice of one request: its token ids, how many of them are in the KV cache
(`num_computed_tokens`), its block table and its seed. A request with n > 1 choices runs as
ONE sequence (standing for all n choices) until its prompt is computed; the step that samples
its first tokens forks it into n sequences that share the prompt's blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core.batch import PromptLogprobsSpec, SampledToken, SampleSpec
from engine.core.protocol import (
    CacheDiagnosis,
    CompletionOutput,
    EngineRequest,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from engine.core.sampling_params import SamplingParams
from engine.core.seeds import derive_seed
from engine.core.spec_ngram import search_bytes

# A request whose choices finished for different reasons is counted under the first of these.
_REASON_PRIORITY = (FinishReason.ERROR, FinishReason.ABORT, FinishReason.LENGTH, FinishReason.STOP)


def make_namespace(
    weights_version: str, adapter: str | None = None, cache_salt: str | None = None
) -> tuple[str, str, str]:
    """The prefix-cache namespace of a request: (weights version, adapter, cache salt).

    KV is shared only between sequences of equal namespaces (DESIGN invariant 3)."""
    return (weights_version, adapter or "", cache_salt or "")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no blocks; admitted by the scheduler in queue order
    RUNNING = "running"  # holds blocks covering its computed (and scheduled) tokens
    FINISHED = "finished"  # holds no blocks; finish_reason is set


@dataclass(eq=False)
class Sequence:
    """One choice of one request. Mutated only by the scheduler and the KV cache manager.

    Tokens are prompt_token_ids + output_token_ids. `num_computed_tokens` of them have KV in
    the blocks of `block_ids`; a decoding sequence has every token computed but the last one
    sampled. After a preemption num_computed_tokens is 0 and every token (outputs included)
    is recomputed as a prefill; generation then continues at t = len(output_token_ids).
    """

    seq_id: int
    request_id: str
    choice_index: int
    prompt_token_ids: list[int]  # shared, read-only, between the choices of a request
    sampling_params: SamplingParams
    seed: int  # already derived for this choice: derive_seed(request seed, choice_index)
    num_choices: int = 1  # choices this sequence stands for: n until it forks, then 1
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)  # the block table
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Prefix cache: the namespace this sequence may share KV in (see make_namespace)
    # and the prompt tokens reused at its FIRST admission (re-admissions after a preemption
    # do not change it).
    cache_namespace: tuple[str, str, str] = ("", "", "")
    num_cached_tokens: int = 0
    num_stored_prompt_tokens: int = 0  # prompt tokens whose KV this sequence added to the cache
    stored_prompt_end: int = 0  # prompt positions before it were counted (stored or served)
    was_admitted: bool = False  # admitted at least once (num_cached_tokens is final)
    cache_diagnosis: CacheDiagnosis | None = None  # why the prompt missed (first admission)
    num_volatile_prefix_tokens: int = 0  # EngineRequest's: a miss inside them is volatile
    arrival_step: int = 0  # the scheduler step it arrived at, for the waiting-age bound
    # Fair share (engine/sched/fair_share.py): whose service this is, and its priority
    # within the tenant (lower first; of a tenant's running sequences, the lowest-priority one
    # is preempted first, and another tenant's only while that one is over its fair share).
    tenant: str = ""
    priority: int = 0
    # sampling_params.prompt_logprobs: the logprobs of prompt tokens 1, 2, ... scored so far
    # (kept across preemptions: those positions are not scored again). None: not asked.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Speculative decoding: drafts rejected outright in a row, and the decode steps left
    # before the next draft (a context that drafts badly stops paying for verification).
    num_spec_misses: int = 0
    num_spec_steps_skipped: int = 0
    # The prompt as the n-gram search's text (spec_ngram.search_bytes), made at the first
    # draft: the prompt never changes, so a step encodes only the outputs.
    _prompt_search_bytes: bytes | None = field(default=None, repr=False)

    # -- token counts -------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens admit() may take from the prefix cache: all but the last (it is
        computed for its logits), and while prompt tokens are still to be scored, none
        whose logits are still owed: cached positions have KV but no logits."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs is not None and not self.has_scored_prompt:
            limit = min(limit, len(self.prompt_logprobs))  # position d scores token d + 1
        return limit

    @property
    def has_scored_prompt(self) -> bool:
        """Every prompt token but the first has its logprob (when they were asked for)."""
        scored = self.prompt_logprobs
        return scored is not None and len(scored) == self.num_prompt_tokens - 1

    @property
    def is_prompt_only(self) -> bool:
        """max_tokens 0: the prompt is computed (and scored, cached), nothing is sampled."""
        return self.sampling_params.max_tokens == 0

    def token_ids(self) -> list[int]:
        """A new list: prompt then outputs."""
        return self.prompt_token_ids + self.output_token_ids

    def search_bytes(self) -> bytes:
        """spec_ngram.search_bytes(self.token_ids()), the prompt's part encoded once."""
        if self._prompt_search_bytes is None:
            self._prompt_search_bytes = search_bytes(self.prompt_token_ids)
        return self._prompt_search_bytes + search_bytes(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids()[start:end] without building the whole list (decodes read one token)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        head = self.prompt_token_ids[start : min(end, num_prompt)]
        return head + self.output_token_ids[: max(0, end - num_prompt)]

    def num_shared_tokens(self, token_ids: list[int], block_size: int) -> int:
        """Length of the common prefix of token_ids and this sequence's tokens, compared a
        block at a time (unrelated sequences differ in their first block: one comparison)."""
        for start in range(0, len(token_ids), block_size):
            mine = token_ids[start : start + block_size]
            theirs = self.token_slice(start, start + len(mine))
            if mine != theirs:
                same = (a == b for a, b in zip(mine, theirs, strict=False))
                return start + next((i for i, s in enumerate(same) if not s), len(theirs))
        return len(token_ids)

    # -- phase ----------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Running, with outputs, and only the last sampled token left to compute."""
        return (
            self.status is SequenceStatus.RUNNING
            and bool(self.output_token_ids)
            and self.num_computed_tokens == self.num_tokens - 1
        )

    def prompt_logprobs_spec(self, start: int, end: int) -> PromptLogprobsSpec | None:
        """The prompt tokens a chunk over positions [start, end) scores, if any is owed.

        Row r (position start + r) predicts token start + r + 1; tokens already scored (a
        chunk recomputed after a preemption) are skipped, never scored twice."""
        if self.prompt_logprobs is None or self.has_scored_prompt:
            return None
        first = len(self.prompt_logprobs) + 1  # the next prompt token to score
        last = min(end, self.num_prompt_tokens - 1)
        assert start < first, f"seq {self.seq_id}: position {first - 1} was reused unscored"
        if last < first:
            return None
        num_top = self.sampling_params.prompt_logprobs or 0
        targets = self.prompt_token_ids[first : last + 1]
        return PromptLogprobsSpec(num_top, first - 1 - start, targets)

    def add_prompt_logprobs(self, scored: list[SampledToken]) -> None:
        assert self.prompt_logprobs is not None, f"seq {self.seq_id} did not ask to score"
        self.prompt_logprobs += [
            TokenLogprob(s.token_id, s.logprob, list(s.top_logprobs)) for s in scored
        ]
        assert len(self.prompt_logprobs) <= self.num_prompt_tokens - 1

    def may_draft(self) -> bool:
        """Whether this decode step may try a draft (one step fewer to wait, if not)."""
        if self.num_spec_steps_skipped > 0:
            self.num_spec_steps_skipped -= 1
            return False
        return True

    def record_draft(self, num_kept: int) -> None:
        """After r drafts in a row kept nothing, skip the next 2**r - 1 steps (up to 15)."""
        self.num_spec_misses = 0 if num_kept else self.num_spec_misses + 1
        self.num_spec_steps_skipped = (1 << min(self.num_spec_misses, 4)) - 1

    def sample_seeds(self) -> list[int]:
        """One seed per token drawn at this sequence's next sample: n before the fork."""
        return [derive_seed(self.seed, i) for i in range(self.num_choices)]

    def sample_spec(self) -> SampleSpec:
        """What the runner needs to draw this sequence's next token(s)."""
        return SampleSpec(
            sampling_params=self.sampling_params,
            seeds=self.sample_seeds(),
            output_index=self.num_output_tokens,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            grammar_keys=self.grammar_keys(),
        )

    def grammar_keys(self) -> list[tuple[str, int]] | None:
        """(request_id, choice_index) per sample seed when a grammar constrains the output."""
        if self.sampling_params.structured is None:
            return None
        return [(self.request_id, i) for i in self.choice_indices()]

    def check_stop(
        self, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> tuple[FinishReason | None, int | None]:
        """(finish reason, stop token id) after the last output token was appended.

        EOS (unless ignore_eos) and stop_token_ids stop only from output index min_tokens on
        (the sampler masks them before); max_tokens and the context window always apply.
        """
        params = self.sampling_params
        token_id = self.output_token_ids[-1]
        if self.num_output_tokens - 1 >= params.min_tokens:
            is_eos = not params.ignore_eos and token_id in eos_token_ids
            if is_eos or token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def completion(
        self, token: SampledToken, reason: FinishReason | None, stop_token_id: int | None
    ) -> CompletionOutput:
        """The delta for one sampled token of this choice (logprobs when asked)."""
        logprobs = None
        if self.sampling_params.logprobs is not None:
            assert token.logprob is not None, f"seq {self.seq_id} asked for logprobs, got none"
            logprobs = [TokenLogprob(token.token_id, token.logprob, list(token.top_logprobs))]
        return CompletionOutput(
            index=self.choice_index,
            new_token_ids=[token.token_id],
            new_logprobs=logprobs,
            finish_reason=reason,
            stop_token_id=stop_token_id,
        )

    def final_completions(self) -> list[CompletionOutput]:
        """An empty, final delta for each choice this finished sequence stood for."""
        assert self.finish_reason is not None
        return [
            CompletionOutput(index=i, new_token_ids=[], finish_reason=self.finish_reason)
            for i in self.choice_indices()
        ]

    def choice_indices(self) -> list[int]:
        """The request's choices this sequence stands for."""
        return list(range(self.choice_index, self.choice_index + self.num_choices))

    # -- transitions -------------------------------------------------------------------------
    def make_child(self, seq_id: int, choice_index: int) -> Sequence:
        """Choice `choice_index` forked from this (unforked) sequence, sharing its prompt.

        The child has the parent's computed-token count but no blocks: the KV cache manager
        gives it a copy of the block table (KVCacheManager.fork).
        """
        assert self.num_choices > 1 and self.choice_index == 0, "only an unforked parent forks"
        assert not self.output_token_ids, "a parent forks at its first sample"
        return Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            choice_index=choice_index,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            seed=derive_seed(self.seed, choice_index),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            cache_namespace=self.cache_namespace,
            num_cached_tokens=self.num_cached_tokens,
            was_admitted=self.was_admitted,
            cache_diagnosis=self.cache_diagnosis,
            arrival_step=self.arrival_step,
            tenant=self.tenant,
            priority=self.priority,
        )

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are already freed; every token will be computed again."""
        assert not self.block_ids, f"seq {self.seq_id} still holds blocks {self.block_ids}"
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def finish(self, reason: FinishReason) -> None:
        assert not self.block_ids, f"seq {self.seq_id} finished holding blocks {self.block_ids}"
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason


@dataclass(eq=False)
class Request:
    """An EngineRequest and its sequences: one until the fork, then n in choice order."""

    engine_request: EngineRequest
    seed: int  # the request seed (given, or drawn at random when the request came in)
    sequences: list[Sequence] = field(default_factory=list)
    has_sent_prompt_logprobs: bool = False

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        return self.sequences[0].num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.sequences)

    @property
    def finish_reason(self) -> FinishReason:
        """The request's reason once finished: the first of _REASON_PRIORITY any choice has."""
        reasons = {seq.finish_reason for seq in self.sequences}
        return next(reason for reason in _REASON_PRIORITY if reason in reasons)

    def make_output(
        self, completions: list[CompletionOutput], error: str | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            outputs=sorted(completions, key=lambda completion: completion.index),
            finished=self.is_finished,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_stored_prompt_tokens=self.sequences[0].num_stored_prompt_tokens,
            error=error,
            prompt_logprobs=self._take_prompt_logprobs(),
            cache_diagnosis=self.sequences[0].cache_diagnosis,
        )

    def _take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The scored prompt, once: in the first delta after the parent scored all of it."""
        parent = self.sequences[0]  # the choice that computed the prompt (children fork later)
        if self.has_sent_prompt_logprobs or not parent.has_scored_prompt:
            return None
        self.has_sent_prompt_logprobs = True
        return list(parent.prompt_logprobs or [])

    def unfinished_sequences(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.is_finished]

    def sequence_for_choice(self, choice_index: int) -> Sequence | None:
        """The sequence standing for this choice (the unforked parent stands for all)."""
        for seq in self.sequences:
            if choice_index in seq.choice_indices():
                return seq
        return None

    def add_children(self, children: list[Sequence]) -> None:
        self.sequences.extend(children)
        self.sequences.sort(key=lambda seq: seq.choice_index)
