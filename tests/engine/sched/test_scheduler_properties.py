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


# -- async scheduling: a lookahead step in flight between operations ---------------------------
class LookaheadDriver:
    """Steps as LLMEngine does with async scheduling: the step after one is scheduled (where
    the outputs allow it) and run before that one's tokens are applied, and stays in flight
    until the next step() call, across the adds, aborts and failures in between."""

    def __init__(self, scheduler: Scheduler, runner: SimulatedRunner) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.in_flight = None
        self.num_lookaheads = 0

    def step(self) -> list:
        scheduler, runner = self.scheduler, self.runner
        if self.in_flight is None:
            out = scheduler.schedule()
            result = runner.execute(out)
        else:
            (out, result), self.in_flight = self.in_flight, None
        ahead = scheduler.schedule_lookahead(out)
        if ahead is not None:
            assert ahead.seqs and len(ahead.seqs) == len(ahead.previous_token_rows)
            self.num_lookaheads += 1
            tokens = [result.sampled[s.seq_id][0].token_id for s in out.seqs]
            self.in_flight = (ahead, runner.execute(ahead, tokens))
        outputs = scheduler.update_from_output(out, result)
        return outputs


def check_books(scheduler: Scheduler) -> None:
    """check_accounting, with the prefix tree's references counted where it holds blocks."""
    if scheduler.kv_cache_manager.prefix_cache is None:
        check_accounting(scheduler)
        return
    scheduler.check_integrity()
    scheduler.kv_cache_manager.check_integrity(scheduler.live_sequences())
    assert scheduler.num_leaked_blocks() == 0


PREFIXES = ([], [7, 3, 9, 1, 4], [5, 5, 6, 2, 8, 8, 1, 3, 0, 9, 4])
async_add_op = st.tuples(
    st.just("add"),
    st.tuples(
        st.sampled_from(PREFIXES), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
    ).map(lambda parts: parts[0] + parts[1]),  # prompts that share prefixes: cache hits
    st.integers(1, 2),  # n
    st.integers(1, 14),  # max_tokens
    st.integers(0, 2),  # min_tokens
    st.booleans(),  # ignore_eos
    st.integers(0, 2**63 - 1),  # seed
)
async_operations = st.lists(
    st.one_of(async_add_op, step_op, step_op, step_op, abort_op, fail_op), min_size=1, max_size=40
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(2, 12),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    enable_prefix_cache=st.booleans(),
    ops=async_operations,
)
def test_lookahead_steps_keep_the_books_the_kv_and_the_outputs(
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enable_prefix_cache: bool,
    ops: list[tuple],
) -> None:
    """The simulated runner checks each step's whole context in KV, the lookahead rows' token
    read from the step before included; the outputs are the prompts' and seeds' alone."""
    scheduler, runner = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=EOS_TOKEN_IDS,
        enable_prefix_cache=enable_prefix_cache,
    )
    driver = LookaheadDriver(scheduler, runner)
    state: dict = {"requests": {}, "results": {}}
    for op in ops:
        if op[0] == "step":
            for _ in range(op[1]):
                collect(state["results"], driver.step())
        else:
            apply(scheduler, runner, op, state)
        check_books(scheduler)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and driver.in_flight is None:
            break
        collect(state["results"], driver.step())
        check_books(scheduler)
    assert not scheduler.has_unfinished_requests() and driver.in_flight is None
    manager = scheduler.kv_cache_manager
    manager.evict(manager.num_total_blocks)
    assert manager.pool.num_free_blocks == manager.pool.num_blocks
    assert all(result.finished for result in state["results"].values())
    assert set(state["results"]) == set(state["requests"])
    check_outputs(state)


def test_the_lookahead_property_test_schedules_lookaheads() -> None:
    """The traffic above reaches lookahead steps: a request decoding alone runs on them."""
    scheduler, runner = make_scheduler(max_model_len=MAX_MODEL_LEN, enable_prefix_cache=True)
    driver = LookaheadDriver(scheduler, runner)
    state: dict = {"requests": {}, "results": {}}
    apply(scheduler, runner, ("add", PREFIXES[2], 1, 12, 0, True, 5), state)
    while scheduler.has_unfinished_requests() or driver.in_flight is not None:
        collect(state["results"], driver.step())
    assert driver.num_lookaheads == 10  # the decodes of tokens 2..11: token 12 ends it
    check_outputs(state)
