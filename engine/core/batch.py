"""Plain-data seams of a step, ints and lists only: the scheduler to the model runner and back,
and the scheduler to the cache auditor (CacheHit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams

# A lookahead decode's input token (SchedulerOutput.previous_token_rows): the step before it
# has not sampled it yet, so the runner reads it on the device. Never a valid token id.
PLACEHOLDER_TOKEN = -1


@dataclass
class SampleSpec:
    """Sample from the logits at a sequence's last scheduled token.

    `seeds` has one entry per token to draw from that row: 1 normally, n when a request
    with n choices finishes its prompt (the choices fork afterwards). The draw for seeds[i]
    is a pure function of (seeds[i], output_index).

    `grammar_keys` (structured output only, else None) has one (request_id, choice_index)
    per seed: the choice whose grammar masks that draw (engine/runtime/grammar.py). Every
    choice has its own matcher, which catches up on output_token_ids.
    """

    sampling_params: SamplingParams
    seeds: list[int]
    output_index: int  # t: output tokens this sequence already has
    # References to the sequence's token lists (read only), for penalties.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar_keys: list[tuple[str, int]] | None = None


@dataclass
class PromptLogprobsSpec:
    """Score prompt tokens at this chunk's positions (echo with logprobs).

    The chunk's rows row_offset, row_offset + 1, ... (row r is position start_pos + r, whose
    logits predict the token after it) give the logprobs of target_token_ids, in order,
    each with its num_top best alternatives.
    """

    num_top: int
    row_offset: int
    target_token_ids: list[int]


@dataclass
class ScheduledSeq:
    """One sequence's share of the flattened batch."""

    seq_id: int
    token_ids: list[int]  # tokens to compute now: a prefill chunk or one decode token
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_ids: list[int]  # block table covering start_pos + len(token_ids) tokens
    sample: SampleSpec | None = None  # None: a prefill chunk that does not reach the end
    prompt_logprobs: PromptLogprobsSpec | None = None  # prompt tokens this chunk scores
    # Speculative decoding: draft tokens after the last one (token_ids ends with them); the
    # runner samples at each of the 1 + len(draft) positions (engine/core/spec_ngram.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Positions before prompt_len hold the request's prompt, the rest tokens it generated: the
    # runner may compute the two kinds on different kernel paths (step_inputs.tile_rows), so a
    # token's path depends on the token, never on the batch. 0: no prompt token known.
    prompt_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class BlockCopy:
    """Copy-on-write: copy every slot of block `src` into block `dst` before the forward."""

    src: int
    dst: int


@dataclass
class BlockSpill:
    """Second KV tier: read block `block_id` out of the pool before the forward (it was just
    evicted from the prefix tree and may be written this step); its bytes go to the tier under
    the namespace and token path (position 0 to the block's end) it holds."""

    block_id: int
    namespace: object
    token_ids: tuple[int, ...]


@dataclass
class BlockLoad:
    """Second KV tier: write `payload` (verified, as read by a BlockSpill) into block
    `block_id` before the copies and the forward."""

    block_id: int
    payload: bytes


@dataclass
class SchedulerOutput:
    """One step. Decodes (one token each) come first in `seqs`, then prefill chunks.

    slot_mapping has one KV slot (block_id * block_size + offset) per token, in the order
    of `seqs` and their token_ids. No slot ever lies in a block that is shared or owned by
    the prefix tree: the scheduler checks this when it builds the mapping.

    block_spills / block_loads: second-tier transfers (engine/kv/tier_link.py), applied first:
    spills read, then loads written, then block_copies, then the forward.
    finished_request_ids: requests that finished (any reason) since the previous
    SchedulerOutput, so the runtime drops what it keeps per request (grammar matchers).
    num_spare_tokens: what other work (the cache audit) may compute after this step: the
    budget left unused, within the fair-share prefill cap.
    previous_token_rows: a lookahead step (scheduled while the step before it runs, every
    sequence a plain decode: Scheduler.schedule_lookahead) gives, per sequence, the row of
    that step's sampled tokens its input token is (token_ids holds PLACEHOLDER_TOKEN); None
    for every other step.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    block_spills: list[BlockSpill] = field(default_factory=list)
    block_loads: list[BlockLoad] = field(default_factory=list)
    num_decodes: int = 0
    finished_request_ids: list[str] = field(default_factory=list)
    num_spare_tokens: int = 0
    previous_token_rows: list[int] | None = None

    @property
    def num_batched_tokens(self) -> int:
        return len(self.slot_mapping)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def has_transfers(self) -> bool:
        """Pool work the runner must do even in a step without sequences."""
        return bool(self.block_copies or self.block_spills or self.block_loads)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # log-softmax of the raw logits, when logprobs were asked
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """seq_id -> one SampledToken per seed of its SampleSpec (in order; with a draft, one per
    verified position instead: 1 + len(draft_token_ids)); prompt_logprobs:
    seq_id -> one SampledToken per target of its PromptLogprobsSpec (the target's logprob);
    spilled_kv: the bytes of each BlockSpill of the step, in order."""

    sampled: dict[int, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[SampledToken]] = field(default_factory=dict)
    spilled_kv: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class CacheHit:
    """A sequence admitted for the first time with a cached prefix (for the cache auditor).

    cached_block_ids: the tree blocks it reused, in order (full blocks, then the source of
    its partial copy); they cover its first num_cached_tokens prompt tokens.
    num_restored_tokens: how many of them were loaded from the second tier (audited at
    audit_restored_sample_rate).
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]  # read only
    cached_block_ids: list[int]
    num_cached_tokens: int
    num_restored_tokens: int = 0
