"""Why a prompt missed the prefix cache (torch-free, no model).

The KV facade classifies every request once, at its first admission, from what it already
knows: how many prompt tokens the cache served, where the reusable part of the prompt ends,
the block size, and two bounded memories kept here:

- PrefixTombstones: the token prefixes of blocks the cache dropped (evicted under pool
  pressure, or quarantined by the audit), so a dropped prefix can be told from one never seen.
  Keys are Python hashes of (namespace, prefix token ids); a hash collision can only turn a
  `no_earlier_prefix` / `diverged` into `evicted`, never make KV match (matching is exact).

The reasons (one per request, first that applies):
  not_cacheable      the cache is off, or the request asks for prompt logprobs (echo with
                     logprobs): every prompt position must be computed for its logits
  full_hit           every reusable token was served (the last prompt token is always computed)
  quarantined        the block at the miss was taken out by the audit
  evicted            the block at the miss was cached once and evicted
  below_block        the miss lies in the prompt's last, partial block: the tree holds only
                     full blocks, so that block was never cacheable
  volatile_prefix    an earlier prompt matched, then differs inside the prompt's first
                     tokens, which the client said hold text it changes per request (an
                     agent's billing line); set by the KV facade over `diverged`
  other_namespace    nothing matched here, but another namespace holds the first block
                     (stated as one bit: nothing of the other namespace is shown)
  no_earlier_prefix  nothing in this namespace starts like it
  diverged           an earlier prefix matched up to the miss, then differs
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from engine.core.protocol import CacheDiagnosis


class MissReason(enum.StrEnum):
    FULL_HIT = "full_hit"
    NO_EARLIER_PREFIX = "no_earlier_prefix"
    DIVERGED = "diverged"
    BELOW_BLOCK = "below_block"
    EVICTED = "evicted"
    OTHER_NAMESPACE = "other_namespace"
    VOLATILE_PREFIX = "volatile_prefix"
    QUARANTINED = "quarantined"
    NOT_CACHEABLE = "not_cacheable"


DEFAULT_NUM_TOMBSTONES = 65536


class PrefixTombstones:
    """The last `capacity` dropped block prefixes and why each was dropped (LRU-bounded)."""

    def __init__(self, capacity: int = DEFAULT_NUM_TOMBSTONES) -> None:
        self.capacity = capacity
        self._reasons: OrderedDict[int, MissReason] = OrderedDict()

    def __len__(self) -> int:
        return len(self._reasons)

    def record(self, namespace: Hashable, prefix_token_ids: Sequence[int], reason: MissReason):
        if self.capacity <= 0:
            return
        key = hash((namespace, tuple(prefix_token_ids)))
        self._reasons[key] = reason
        self._reasons.move_to_end(key)
        while len(self._reasons) > self.capacity:
            self._reasons.popitem(last=False)

    def reason_for(self, namespace: Hashable, prefix_token_ids: Sequence[int]) -> MissReason | None:
        if not self._reasons:
            return None
        return self._reasons.get(hash((namespace, tuple(prefix_token_ids))))


def miss_block_end(num_matched_tokens: int, block_size: int) -> int:
    """The end (exclusive) of the block the first unmatched token falls in."""
    return (num_matched_tokens // block_size + 1) * block_size


def classify(
    num_prompt_tokens: int,
    num_reusable_tokens: int,
    num_matched_tokens: int,
    block_size: int,
    dropped_reason: MissReason | None,
    is_in_other_namespace: bool,
    is_cacheable: bool = True,
) -> MissReason:
    """The reason for a request's miss (see the module docstring for the order)."""
    if not is_cacheable:
        return MissReason.NOT_CACHEABLE
    if 0 < num_reusable_tokens <= num_matched_tokens:
        return MissReason.FULL_HIT
    if dropped_reason is not None:
        return dropped_reason
    if miss_block_end(num_matched_tokens, block_size) > num_prompt_tokens:
        return MissReason.BELOW_BLOCK
    if num_matched_tokens == 0:
        if is_in_other_namespace:
            return MissReason.OTHER_NAMESPACE
        return MissReason.NO_EARLIER_PREFIX
    return MissReason.DIVERGED


def make_diagnosis(
    num_prompt_tokens: int, num_matched_tokens: int, block_size: int, reason: MissReason
) -> CacheDiagnosis:
    first_miss = None if reason == MissReason.FULL_HIT else num_matched_tokens
    return CacheDiagnosis(
        num_prompt_tokens=num_prompt_tokens,
        num_matched_tokens=num_matched_tokens,
        block_size=block_size,
        first_miss_index=first_miss,
        reason=str(reason),
    )
