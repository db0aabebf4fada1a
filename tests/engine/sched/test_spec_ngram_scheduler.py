"""Speculative steps in the scheduler over simulated KV memory (no torch, no model): which
tokens are scheduled, which blocks a rejected draft gives back, exact ids."""

from __future__ import annotations

from engine.core.batch import ModelRunnerOutput, SampledToken
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.core.spec_ngram import NgramProposer
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler

BLOCK_SIZE = 4


def make(
    enable_prefix_cache: bool = False, num_blocks: int = 16, max_decodes: int = 0
) -> Scheduler:
    pool = BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    manager = KVCacheManager(pool, enable_prefix_cache=enable_prefix_cache)
    return Scheduler(
        manager, 8, 64, 64, (), weights_version="w", proposer=NgramProposer(4, 1, 2),
        speculative_max_decodes=max_decodes,
    )  # fmt: skip


def answer(scheduler: Scheduler, chosen: dict[int, list[int]]):
    out = scheduler.schedule()
    runner = ModelRunnerOutput({s: [SampledToken(t) for t in ts] for s, ts in chosen.items()})
    outputs = scheduler.update_from_output(out, runner)
    scheduler.check_integrity()
    return out, outputs


def test_a_draft_is_verified_and_its_rejected_block_given_back():
    scheduler = make()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    scheduler.add_request(EngineRequest("r", [1, 2, 3, 1, 2], params))
    answer(scheduler, {0: [3]})  # prefill; the model says 3: tokens 1 2 3 1 2 3
    seq = scheduler.get_seq(0)
    assert seq.block_ids == [0, 1]
    out, outputs = answer(scheduler, {0: [1, 2, 9, 7]})
    (verified,) = out.seqs
    # "2 3" occurred at position 1, followed by 1 2 3: the draft; the last token comes first.
    assert (verified.start_pos, verified.token_ids) == (5, [3, 1, 2, 3])
    assert verified.draft_token_ids == [1, 2, 3] and out.num_decodes == 0
    assert verified.block_ids == [0, 1, 2] and out.slot_mapping == [5, 6, 7, 8]
    # 1 and 2 agree, 3 does not (the model chose 9): 1 2 9 are kept, position 8 is given back.
    assert outputs[0].outputs[0].new_token_ids == [1, 2, 9]
    assert seq.output_token_ids == [3, 1, 2, 9]
    assert (seq.num_computed_tokens, seq.block_ids) == (8, [0, 1])
    assert scheduler.kv_cache_manager.num_free_blocks == 14
    assert (
        scheduler.counters.num_spec_draft_tokens,
        scheduler.counters.num_spec_accepted_tokens,
    ) == (3, 2)


def test_a_fully_kept_draft_keeps_its_blocks_and_the_cache_gets_them():
    scheduler = make(enable_prefix_cache=True)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    scheduler.add_request(EngineRequest("r", [1, 2, 3, 1, 2], params))
    answer(scheduler, {0: [3]})
    answer(scheduler, {0: [1, 2, 3, 4]})  # the whole draft 1 2 3 kept, then 4
    seq = scheduler.get_seq(0)
    assert seq.token_ids() == [1, 2, 3, 1, 2, 3, 1, 2, 3, 4]
    assert (seq.num_computed_tokens, seq.block_ids) == (9, [0, 1, 2])
    assert scheduler.kv_cache_manager.num_inserted_tokens(seq) == 8  # two full blocks cached


def test_no_draft_past_max_tokens():
    scheduler = make()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scheduler.add_request(EngineRequest("r", [1, 2, 3, 1, 2], params))
    answer(scheduler, {0: [3]})
    out, outputs = answer(scheduler, {0: [1, 2]})
    assert out.seqs[0].draft_token_ids == [1]  # 2 outputs left: one drafted, one after it
    assert outputs[0].outputs[0].new_token_ids == [1, 2] and outputs[0].finished
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_a_stop_inside_a_kept_draft_ends_the_choice_there():
    scheduler = make()
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(1,))
    scheduler.add_request(EngineRequest("r", [1, 2, 3, 1, 2], params))
    answer(scheduler, {0: [3]})
    _, outputs = answer(scheduler, {0: [1, 2, 3, 4]})  # all kept, but 1 stops the choice
    choice = outputs[0].outputs[0]
    assert (choice.new_token_ids, choice.stop_token_id) == ([1], 1)
    assert outputs[0].finished and scheduler.kv_cache_manager.num_free_blocks == 16


def test_a_drafted_decode_checks_the_pool_once(monkeypatch):
    """The draft's slots are allocated in the same call that finds room for them."""
    scheduler = make()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    scheduler.add_request(EngineRequest("r", [1, 2, 3, 1, 2], params))
    answer(scheduler, {0: [3]})
    manager = scheduler.kv_cache_manager
    blocks_needed = manager._blocks_needed
    asked: list[tuple[int, int]] = []

    def spy(seq, num_new_tokens):
        asked.append((seq.seq_id, num_new_tokens))
        return blocks_needed(seq, num_new_tokens)

    monkeypatch.setattr(manager, "_blocks_needed", spy)
    out = scheduler.schedule()
    assert asked == [(0, 4)]  # last token + draft 1 2 3, one room check
    assert out.seqs[0].block_ids == [0, 1, 2] and out.slot_mapping == [5, 6, 7, 8]


def test_a_draft_the_pool_cannot_hold_is_dropped_without_preempting():
    scheduler = make(num_blocks=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    scheduler.add_request(EngineRequest("a", [1, 2, 3, 1, 2], params))
    scheduler.add_request(EngineRequest("b", [5, 6, 7, 8, 9], params))
    answer(scheduler, {0: [3], 1: [4]})  # a: blocks 0 1, b: blocks 2 3; the pool is full
    out, outputs = answer(scheduler, {1: [6], 0: [1]})
    # a's draft 1 2 3 needs a fifth block: dropped, a decodes one token into its own block 1,
    # after b's plain decode; nobody is preempted for it.
    assert [(s.seq_id, s.token_ids, s.draft_token_ids) for s in out.seqs] == [
        (1, [4], []),
        (0, [3], []),
    ]
    assert [s.block_ids for s in out.seqs] == [[2, 3], [0, 1]]
    assert out.slot_mapping == [13, 5] and out.num_decodes == 1
    assert scheduler.counters.num_preemptions == 0
    assert [o.outputs[0].new_token_ids for o in outputs] == [[6], [1]]
    assert scheduler.kv_cache_manager.num_free_blocks == 0


def test_drafts_stop_while_more_sequences_decode_than_max_decodes():
    scheduler = make(num_blocks=32, max_decodes=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    scheduler.add_request(EngineRequest("a", [1, 2, 3, 1, 2], params))
    scheduler.add_request(EngineRequest("b", [5, 6, 7, 5, 6], params))
    answer(scheduler, {0: [3], 1: [7]})  # both prefilled; each context repeats itself
    out, _ = answer(scheduler, {0: [1], 1: [5]})
    # Two decode: one token each, no draft, though both have a match to propose.
    assert [s.draft_token_ids for s in out.seqs] == [[], []] and out.num_decodes == 2
    assert [s.token_ids for s in out.seqs] == [[3], [7]]
    scheduler.abort_request("b")
    out, _ = answer(scheduler, {0: [2, 3, 1, 2]})
    # One decodes: it drafts again ("3 1" occurred before, followed by 2 3 1).
    (alone,) = out.seqs
    assert alone.draft_token_ids == [2, 3, 1] and alone.token_ids == [1, 2, 3, 1]
    assert scheduler.counters.num_spec_draft_tokens == 3
