"""Property test: random add / step / abort / fail sequences over small pools.

After every operation the scheduler's integrity holds and the pool's refcounts sum to the
references held by live sequences; every choice's tokens equal what its prompt and seed alone
give at each output index (tests/engine/fakes.py: preemption, forks and copy-on-write never
change an output, nor move a token to another index or another choice); when all requests have
ended, every block is free.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.errors import ChoiceNotForked
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.simulation import VOCAB, SimulatedRunner, make_scheduler
from tests.engine.fakes import EOS_TOKEN_IDS, check_outputs, collect, step

MAX_MODEL_LEN = 32

add_op = st.tuples(
    st.just("add"),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_MODEL_LEN - 1),  # prompt
    st.integers(1, 3),  # n
    st.integers(1, 12),  # max_tokens
    st.integers(0, 2),  # min_tokens
    st.booleans(),  # ignore_eos
    st.integers(0, 2**63 - 1),  # seed
)
step_op = st.tuples(st.just("step"), st.integers(1, 8))
abort_op = st.tuples(st.just("abort"), st.integers(0, 30), st.sampled_from([None, 0, 1, 2]))
fail_op = st.tuples(st.just("fail"), st.integers(0, 60))
operations = st.lists(
    st.one_of(add_op, step_op, step_op, step_op, abort_op, fail_op), min_size=1, max_size=40
)


def check_accounting(scheduler: Scheduler) -> None:
    scheduler.check_integrity()
    live = scheduler.live_sequences()
    pool = scheduler.kv_cache_manager.pool
    assert pool.total_refcount() == sum(len(seq.block_ids) for seq in live)
    assert scheduler.num_leaked_blocks() == 0


def apply(scheduler: Scheduler, runner: SimulatedRunner, op: tuple, state: dict) -> None:
    kind = op[0]
    if kind == "add":
        _, prompt, n, max_tokens, min_tokens, ignore_eos, seed = op
        params = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            seed=seed,
        )
        request_id = f"r{len(state['requests'])}"
        state["requests"][request_id] = (prompt, params)
        scheduler.add_request(EngineRequest(request_id, prompt, params))
    elif kind == "step":
        for _ in range(op[1]):
            collect(state["results"], step(scheduler, runner))
    elif kind == "abort" and state["requests"]:
        request_id = f"r{op[1] % len(state['requests'])}"
        try:
            output = scheduler.abort_request(request_id, op[2])
        except ChoiceNotForked:  # one choice of a request that has not forked yet
            return
        if output is not None:
            collect(state["results"], [output])
    elif kind == "fail" and scheduler.live_sequences():
        live = scheduler.live_sequences()
        collect(state["results"], scheduler.fail_seqs([live[op[1] % len(live)].seq_id], "x"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(2, 10),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    ops=operations,
)
def test_random_traffic_keeps_the_books_and_the_outputs(
    num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, ops: list[tuple]
) -> None:
    scheduler, runner = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=EOS_TOKEN_IDS,
    )
    state: dict = {"requests": {}, "results": {}}
    for op in ops:
        apply(scheduler, runner, op, state)
        check_accounting(scheduler)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        collect(state["results"], step(scheduler, runner))
        check_accounting(scheduler)
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(result.finished for result in state["results"].values())
    assert set(state["results"]) == set(state["requests"])
    check_outputs(state)
