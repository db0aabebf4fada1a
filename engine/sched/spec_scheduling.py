"""Speculative decoding in the scheduler: which decodes carry a draft, and what a verified
step keeps (torch-free).

Drafting: in a step where at most max_decodes sequences decode (a batch bound by reading the
weights, whose drafted rows cost little), a decoding sequence gets an n-gram draft
(spec_ngram.NgramProposer) unless it is grammar-constrained, backs off after drafts that kept
nothing (Sequence.may_draft / record_draft), or has no room left (max_tokens, the context
window). The Scheduler schedules drafted sequences after the plain decodes, each with its last
token plus the draft (1 + k positions, verified like a prefill chunk); a draft is cut to the
step's token budget and dropped when the pool cannot hold it without preempting (a draft never
preempts anyone).

Verification: the draft's prefix that agrees with the target's choices is kept, then the
target's next choice; the KV slots past the kept tokens go back (num_computed_tokens goes
back, whole blocks are freed).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.core.batch import ModelRunnerOutput, SampledToken, ScheduledSeq
from engine.core.protocol import CompletionOutput
from engine.core.sequence import Sequence
from engine.core.spec_ngram import NgramProposer, merge_completions, num_accepted
from engine.kv.kv_cache_manager import KVCacheManager

# OutputProcessor._append_token: appends one token, counts it, applies stop checks (may
# retire seq).
AppendToken = Callable[[Sequence, SampledToken], CompletionOutput]


class SpecScheduling:
    """The Scheduler's speculative-decoding decisions; with no proposer nothing is drafted.

    Holds no per-step state (per-sequence backoff lives on Sequence) and reaches KV memory
    only through KVCacheManager. Called from the engine thread, inside schedule() and
    update_from_output().
    """

    def __init__(
        self,
        proposer: NgramProposer | None,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        max_decodes: int = 0,
    ) -> None:
        self.proposer = proposer
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_decodes = max_decodes  # draft only in steps with at most this many decodes

    def drafts_among(self, num_decodes: int) -> bool:
        """Whether a step with num_decodes decoding sequences may draft at all: a batch of
        one (or a few) is bound by reading the weights, so drafted rows cost little; past
        max_decodes (0: no limit) every decode runs one token."""
        return self.proposer is not None and (
            self.max_decodes == 0 or num_decodes <= self.max_decodes
        )

    def draft(self, seq: Sequence, max_num_tokens: int) -> list[int]:
        """Draft tokens for a decoding seq: none past max_tokens or the context window (the
        kept draft is followed by one more token), none under a grammar, none while the
        seq backs off after drafts that kept nothing (Sequence.record_draft)."""
        if self.proposer is None or seq.sampling_params.structured is not None:
            return []
        if not seq.may_draft():
            return []
        num_outputs_left = seq.sampling_params.max_tokens - seq.num_output_tokens
        room = min(num_outputs_left, self.max_model_len - seq.num_tokens) - 1
        return self.proposer.propose_in(seq.search_bytes(), min(room, max_num_tokens))

    def allocate(self, seq: Sequence, draft: list[int], budget: int) -> list[int]:
        """The draft to schedule after seq's last token within `budget` tokens, cut to fit,
        with the slots of all 1 + k tokens allocated; [] (nothing allocated: decode one token
        as usual) when there is no draft left or the pool cannot hold it without preempting."""
        draft = draft[: budget - 1]
        if draft and self.kv_cache_manager.allocate_slots(seq, 1 + len(draft)):
            return draft
        return []

    def verify(
        self,
        seq: Sequence,
        scheduled: ScheduledSeq,
        runner_output: ModelRunnerOutput,
        append_token: AppendToken,
    ) -> tuple[CompletionOutput, int]:
        """Keep the draft's prefix that the target's choices agree with, then the target's
        next choice; give back the KV slots past the kept tokens. Returns one delta for them
        all and the number of draft tokens kept."""
        draft = scheduled.draft_token_ids
        chosen = runner_output.sampled.get(seq.seq_id)
        if chosen is None or len(chosen) != 1 + len(draft):
            raise RuntimeError(
                f"runner returned {chosen!r} for seq {seq.seq_id}, expected {1 + len(draft)}"
            )
        num_kept = num_accepted(draft, chosen)
        seq.record_draft(num_kept)
        # Positions up to the last kept draft token have KV; the rest of the slots go back.
        self.kv_cache_manager.free_slots_past(seq, scheduled.start_pos + 1 + num_kept)
        seq.num_computed_tokens = scheduled.start_pos + 1
        parts = []
        for i, token in enumerate(chosen[: num_kept + 1]):
            parts.append(append_token(seq, token))
            if parts[-1].finish_reason is not None:
                # A stop: later kept tokens are never output.
                return merge_completions(parts), num_kept
            if i < num_kept:
                seq.num_computed_tokens += 1  # this token's KV came with the draft
        self.kv_cache_manager.insert_prefix(seq)
        return merge_completions(parts), num_kept
