"""Miss reasons at first admission, through the KV facade alone (no model, no scheduler)."""

from __future__ import annotations

import pytest

from engine.core.protocol import CacheDiagnosis
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.cache_diagnosis import MissReason, PrefixTombstones, classify
from engine.kv.kv_cache_manager import KVCacheManager

BS = 4  # block size
ALICE, BOB = make_namespace("w", cache_salt="alice"), make_namespace("w", cache_salt="bob")


def make_manager(num_blocks: int = 16, cache: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks=num_blocks, block_size=BS), cache)


_ids = iter(range(10_000))


def run(kv: KVCacheManager, prompt: list[int], namespace=ALICE, **params) -> CacheDiagnosis:
    """Admit, diagnose, compute the whole prompt, insert, free: one request's life."""
    seq = Sequence(
        seq_id=next(_ids),
        request_id="r",
        choice_index=0,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        seed=0,
        cache_namespace=namespace,
    )
    num_new = kv.admit(seq, token_budget=1000)
    assert num_new is not None
    diagnosis = kv.diagnose(seq)
    seq.num_computed_tokens += num_new
    kv.insert_prefix(seq)
    kv.free(seq)
    kv.check_integrity([])
    return diagnosis


def test_first_request_has_no_earlier_prefix() -> None:
    kv = make_manager()
    assert run(kv, list(range(10))) == CacheDiagnosis(10, 0, BS, 0, "no_earlier_prefix")


def test_same_prompt_again_is_a_full_hit() -> None:
    kv = make_manager()
    run(kv, list(range(9)))
    assert run(kv, list(range(9))) == CacheDiagnosis(9, 8, BS, None, "full_hit")


def test_divergence_points_at_the_first_differing_token() -> None:
    kv = make_manager()
    run(kv, list(range(12)))
    prompt = [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11]
    # token 5 differs: blocks [0..3] full, 1 token of the next block matches (copied)
    assert run(kv, prompt) == CacheDiagnosis(12, 5, BS, 5, "diverged")


def test_a_prompt_inside_its_first_block_is_below_block() -> None:
    kv = make_manager()
    run(kv, [1, 2, 3])
    assert run(kv, [1, 2, 3]).reason == "below_block"  # nothing cacheable ever: 3 < 4 tokens


def test_a_miss_in_the_last_partial_block_is_below_block() -> None:
    kv = make_manager()
    run(kv, list(range(6)))  # caches block [0..3]; tokens 4, 5 were never a full block
    assert run(kv, list(range(6))) == CacheDiagnosis(6, 4, BS, 4, "below_block")


def test_an_evicted_prefix_is_told_from_a_never_seen_one() -> None:
    kv = make_manager(num_blocks=4)
    run(kv, list(range(8)))  # caches two blocks
    run(kv, list(range(100, 116)))  # needs all 4 blocks: evicts both
    assert kv.num_evictions == 2
    assert run(kv, list(range(8))) == CacheDiagnosis(8, 0, BS, 0, "evicted")
    assert run(kv, list(range(200, 208))).reason == "no_earlier_prefix"


def test_another_namespace_is_one_bit() -> None:
    kv = make_manager()
    run(kv, list(range(8)), namespace=BOB)
    assert run(kv, list(range(8)), namespace=ALICE) == CacheDiagnosis(
        8, 0, BS, 0, "other_namespace"
    )


def test_a_quarantined_block_is_named() -> None:
    kv = make_manager()
    run(kv, list(range(12)))
    second_block = sorted(kv.cached_block_ids())[1]  # blocks 0, 1, 2 in order
    kv.quarantine([second_block])
    assert run(kv, list(range(12))) == CacheDiagnosis(12, 4, BS, 4, "quarantined")


def test_cache_off_and_prompt_logprobs_are_not_cacheable() -> None:
    assert run(make_manager(cache=False), list(range(8))).reason == "not_cacheable"
    kv = make_manager()
    run(kv, list(range(8)))
    assert run(kv, list(range(8)), prompt_logprobs=0).reason == "not_cacheable"


def test_miss_tokens_sum_to_the_tokens_not_served() -> None:
    kv = make_manager(num_blocks=6)
    # new; tokens 8-9 never filled a block; diverges at 2; one token (nothing to reuse); new
    prompts = [list(range(10)), list(range(10)), [0, 1, 7, 7, 7, 7], [5], list(range(40, 60))]
    diagnoses = [run(kv, prompt) for prompt in prompts]
    not_served = sum(d.num_prompt_tokens - d.num_matched_tokens for d in diagnoses)
    assert sum(kv.miss_tokens_by_reason.values()) == not_served
    assert dict(kv.miss_tokens_by_reason) == {
        "no_earlier_prefix": 10 + 20,
        "below_block": 2 + 1,
        "diverged": 4,
    }


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ((8, 7, 7, None, False), MissReason.FULL_HIT),
        ((8, 7, 0, None, True), MissReason.OTHER_NAMESPACE),
        ((8, 7, 0, MissReason.EVICTED, True), MissReason.EVICTED),
        ((8, 7, 7, None, False, False), MissReason.NOT_CACHEABLE),
        ((1, 0, 0, None, False), MissReason.BELOW_BLOCK),
        ((8, 7, 4, None, False), MissReason.DIVERGED),
        ((7, 6, 4, None, False), MissReason.BELOW_BLOCK),
    ],
)
def test_classify_order(args, reason) -> None:
    num_prompt, num_reusable, num_matched, *rest = args
    assert classify(num_prompt, num_reusable, num_matched, BS, *rest) == reason


def test_tombstones_are_bounded() -> None:
    stones = PrefixTombstones(capacity=2)
    for first in range(3):
        stones.record(ALICE, [first], MissReason.EVICTED)
    assert len(stones) == 2
    assert stones.reason_for(ALICE, [0]) is None
    assert stones.reason_for(ALICE, [2]) == MissReason.EVICTED
    assert stones.reason_for(BOB, [2]) is None
