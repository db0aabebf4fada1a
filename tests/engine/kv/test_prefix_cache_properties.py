"""Property test: random traffic through scheduler + KV cache manager + radix tree.

Random add (prompts often derived from earlier ones: the same, extended by an earlier
answer, one token changed, cut at the front or the back; one of two cache salts) / step /
abort / fail / evict operations run over small pools with the fake runner, whose simulated
KV memory holds one token id per slot. After every operation:
- integrity holds, and the pool's refcounts sum to the block-table references of live
  sequences plus the tree's blocks;
- the oracle, a dict from namespace to the token tuples of every request so far, agrees with
  the tree: matching each tuple finds blocks whose simulated KV holds exactly those tokens,
  and those blocks are all the tree holds (the tree caches nothing no request computed);
- no slot mapping or copy destination targets a block that is shared or tree-owned.
At the end every choice's tokens are what its prompt and seed alone give at each output index
(tests/engine/fakes.py), each request reused at most what an earlier request of its namespace
had in common with it, every block is free or held by the tree alone, and a full eviction
frees them all.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.batch import ModelRunnerOutput, SchedulerOutput
from engine.core.protocol import EngineRequest
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import make_namespace
from engine.sched.scheduler import Scheduler
from engine.simulation import BLOCK_SIZE, SimulatedRunner, make_scheduler
from tests.engine.fakes import EOS_TOKEN_IDS, check_outputs, collect, step

MAX_MODEL_LEN = 32
SALTS = (None, "tenant-b")


class CheckedRunner(SimulatedRunner):
    """SimulatedRunner that also checks every write target is private (invariant 2)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        pool = self.scheduler.kv_cache_manager.pool
        targets = {slot // BLOCK_SIZE for slot in out.slot_mapping}
        targets |= {copy.dst for copy in out.block_copies}
        for block_id in targets:
            assert pool.refcount(block_id) == 1, f"write into shared block {block_id}"
            assert not pool.is_tree_owned(block_id), f"write into cached block {block_id}"
        return super().execute(out)


add_op = st.tuples(
    st.just("add"),
    st.sampled_from(["fresh", "same", "same", "turn", "turn", "change", "front", "back"]),
    st.integers(0, 50),  # which earlier request the prompt derives from
    st.lists(st.integers(6, 9), min_size=2, max_size=12),  # new tokens (no EOS among them)
    st.integers(0, 100),  # where to change / cut
    st.sampled_from(SALTS),
    st.integers(1, 2),  # n
    st.integers(1, 8),  # max_tokens
    st.booleans(),  # ignore_eos
    st.integers(0, 3),  # seed: few seeds, so answers repeat too
)
step_op = st.tuples(st.just("step"), st.integers(1, 6))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))
fail_op = st.tuples(st.just("fail"), st.integers(0, 50))
evict_op = st.tuples(st.just("evict"), st.integers(1, 6))
# Weighted: traffic mostly adds and steps, so prefixes get cached and reused.
op_kinds = st.sampled_from(["add"] * 3 + ["step"] * 4 + ["abort", "fail", "evict"])
by_kind = {"add": add_op, "step": step_op, "abort": abort_op, "fail": fail_op, "evict": evict_op}
operations = st.lists(op_kinds.flatmap(by_kind.__getitem__), min_size=6, max_size=40)


def derive_prompt(op: tuple, state: dict) -> list[int]:
    _, edit, base_index, new_tokens, where, *_ = op
    if edit == "fresh" or not state["requests"]:
        return new_tokens
    base_id = f"r{base_index % len(state['requests'])}"
    base, _ = state["requests"][base_id]
    answer = state["results"].get(base_id)
    prompt = {
        "same": base,
        "turn": base + (answer.tokens.get(0, []) if answer else []) + new_tokens,
        "change": base[: where % len(base)] + new_tokens[:1] + base[where % len(base) + 1 :],
        "front": base[1 + where % len(base) :] + new_tokens,
        "back": base[: 1 + where % len(base)],
    }[edit]
    return prompt[: MAX_MODEL_LEN - 1] or new_tokens


def apply(scheduler: Scheduler, runner: SimulatedRunner, op: tuple, state: dict) -> None:
    kind = op[0]
    if kind == "add":
        *_, salt, n, max_tokens, ignore_eos, seed = op
        prompt = derive_prompt(op, state)
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos, seed=seed)
        request_id = f"r{len(state['requests'])}"
        state["requests"][request_id] = (prompt, params)
        state["salts"][request_id] = salt
        scheduler.add_request(EngineRequest(request_id, prompt, params, cache_salt=salt))
    elif kind == "step":
        for _ in range(op[1]):
            collect(state["results"], step(scheduler, runner))
    elif kind == "abort" and state["requests"]:
        output = scheduler.abort_request(f"r{op[1] % len(state['requests'])}")
        if output is not None:
            collect(state["results"], [output])
    elif kind == "fail" and scheduler.live_sequences():
        live = scheduler.live_sequences()
        collect(state["results"], scheduler.fail_seqs([live[op[1] % len(live)].seq_id], "x"))
    elif kind == "evict":
        scheduler.kv_cache_manager.evict(op[1])


def known_sequences(state: dict) -> dict[tuple, list[list[int]]]:
    """The oracle: namespace -> every request's prompt + each choice's tokens so far."""
    known: dict[tuple, list[list[int]]] = {}
    for request_id, (prompt, _) in state["requests"].items():
        namespace = make_namespace("w0", None, state["salts"][request_id])
        result = state["results"].get(request_id)
        answers = list(result.tokens.values()) if result else []
        known.setdefault(namespace, []).extend(prompt + a for a in answers or [[]])
    return known


def check_books(scheduler: Scheduler, runner: SimulatedRunner, state: dict) -> None:
    scheduler.check_integrity()
    kv = scheduler.kv_cache_manager
    tree = kv.prefix_cache
    live = scheduler.live_sequences()
    held = sum(len(seq.block_ids) for seq in live)
    assert kv.pool.total_refcount() == held + tree.num_tree_blocks
    assert scheduler.num_leaked_blocks() == 0
    found: set[int] = set()
    for namespace, token_lists in known_sequences(state).items():
        for token_ids in token_lists:
            match = tree.match(namespace, token_ids)
            for index, block_id in enumerate(match.full_block_ids):
                block = runner.kv[block_id * BLOCK_SIZE : (block_id + 1) * BLOCK_SIZE]
                assert block == token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
            found.update(match.full_block_ids)
    assert found == set(tree.tree_block_ids())


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_cached_tokens(state: dict) -> None:
    """A request reused at most what an earlier request of its namespace shared with it."""
    known = {
        request_id: [prompt + tokens for tokens in result.tokens.values()] or [prompt]
        for request_id, result in state["results"].items()
        for prompt, _ in [state["requests"][request_id]]
    }
    order = list(state["requests"])
    for index, request_id in enumerate(order):
        result = state["results"][request_id]
        prompt, _ = state["requests"][request_id]
        earlier = [r for r in order[:index] if state["salts"][r] == state["salts"][request_id]]
        bound = max(
            (common_prefix_len(prompt, t) for r in earlier for t in known.get(r, [])), default=0
        )
        assert result.num_cached_tokens <= min(bound, len(prompt) - 1), request_id


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(4, 16),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "longest-prefix-first"]),
    ops=operations,
)
def test_random_traffic_shares_only_what_is_equal_and_keeps_the_books(
    num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, policy: str, ops: list
) -> None:
    scheduler, _ = make_scheduler(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=EOS_TOKEN_IDS,
        enable_prefix_cache=True,
        scheduling_policy=policy,
    )
    runner = CheckedRunner(scheduler)
    state: dict = {"requests": {}, "results": {}, "salts": {}}
    for op in ops:
        apply(scheduler, runner, op, state)
        check_books(scheduler, runner, state)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        collect(state["results"], step(scheduler, runner))
        check_books(scheduler, runner, state)
    assert not scheduler.has_unfinished_requests()
    assert set(state["results"]) == set(state["requests"])
    check_outputs(state)
    check_cached_tokens(state)
    kv = scheduler.kv_cache_manager
    assert all(kv.pool.refcount(b) in (0, 1) for b in range(num_blocks))
    assert all(kv.pool.is_tree_owned(b) for b in range(num_blocks) if kv.pool.refcount(b))
    kv.evict(num_blocks)
    assert kv.pool.num_free_blocks == num_blocks and kv.prefix_cache.num_tree_blocks == 0
