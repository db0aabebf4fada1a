"""The scheduler over real KV memory with no model: a simulated runner for the scheduler's tests
and the benchmarks that simulate serving (torch-free, as SGLang builds its radix cache "for
simulation").

The simulated model: output token t of a choice is a pure function of (its prompt, its seed, t),
like the real sampler's draw (invariant 4). The runner computes it from what the scheduler hands
it (the SampleSpec's prompt, seeds and output_index), so a token drawn at the wrong output index,
or a choice that gets another choice's token, shows up as a wrong output in a test's oracle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.core.batch import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_tier import KVTier
from engine.sched.scheduler import Scheduler

VOCAB = 64
BLOCK_SIZE = 4


def next_token(prompt: Sequence[int], seed: int, output_index: int) -> int:
    """The simulated model's output token `output_index` (t) for a choice seeded `seed`.

    With seed 0 a choice counts on from its prompt's last token (prompt [.., 6] gives 7, 8,
    9, ...), which keeps the scenario tests' numbers readable.
    """
    return (prompt[-1] + 1 + output_index + seed) % VOCAB


class SimulatedRunner:
    """Simulated KV memory holding one token id per slot, in place of a ModelRunner.

    Each step it reads the second tier's spills (a block's slots as JSON), writes its loads,
    applies the block copies, writes every scheduled token into its slot, then
    reads each scheduled sequence's whole context back through its block table and asserts it
    equals the sequence's tokens: a sharing, copy-on-write or slot bug fails there. The sampled
    tokens come from next_token(spec prompt, seed, spec output_index).

    A lookahead step (SchedulerOutput.previous_token_rows) takes its rows' input tokens from
    `previous_tokens`, the tokens the step before it sampled, one per row, as a GPU reads them
    on the device; its sequences still hold the placeholder then.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        manager = scheduler.kv_cache_manager
        self.scheduler = scheduler
        self.block_size = manager.block_size
        self.kv: list[int | None] = [None] * (manager.num_total_blocks * self.block_size)
        self.steps: list[SchedulerOutput] = []

    def execute(
        self, out: SchedulerOutput, previous_tokens: list[int] | None = None
    ) -> ModelRunnerOutput:
        self.steps.append(out)
        pending: dict[int, int] = {}  # seq_id -> its input token, for lookahead rows
        if out.previous_token_rows is not None:
            assert previous_tokens is not None, "a lookahead step without the step before it"
            for scheduled, row in zip(out.seqs, out.previous_token_rows, strict=True):
                assert scheduled.token_ids == [PLACEHOLDER_TOKEN]
                pending[scheduled.seq_id] = previous_tokens[row]
        spilled = [self.block_bytes(spill.block_id) for spill in out.block_spills]
        for load in out.block_loads:
            content = json.loads(load.payload)
            assert len(content) == self.block_size, f"block {load.block_id}: a short payload"
            self.kv[load.block_id * self.block_size : (load.block_id + 1) * self.block_size] = (
                content
            )
        blocks = [self._block(copy.src) for copy in out.block_copies]  # gather, then scatter
        for copy, content in zip(out.block_copies, blocks, strict=True):
            self.kv[copy.dst * self.block_size : (copy.dst + 1) * self.block_size] = content
        tokens = [
            pending.get(scheduled.seq_id, token)
            for scheduled in out.seqs
            for token in scheduled.token_ids
        ]
        assert len(tokens) == len(out.slot_mapping)
        for slot, token in zip(out.slot_mapping, tokens, strict=True):
            self.kv[slot] = token
        sampled = {s.seq_id: self._sample(s, pending.get(s.seq_id)) for s in out.seqs if s.sample}
        return ModelRunnerOutput(sampled, spilled_kv=spilled)

    def block_bytes(self, block_id: int) -> bytes:
        """A block's slots as the second tier keeps them (JSON)."""
        return json.dumps(self._block(block_id)).encode()

    def _block(self, block_id: int) -> list[int | None]:
        return self.kv[block_id * self.block_size : (block_id + 1) * self.block_size]

    def _sample(self, scheduled: ScheduledSeq, pending: int | None) -> list[SampledToken]:
        """pending: a lookahead row's input token, which its sequence holds as a placeholder."""
        size = self.block_size
        context = [
            self.kv[scheduled.block_ids[p // size] * size + p % size]
            for p in range(scheduled.context_len)
        ]
        seq = self.scheduler.get_seq(scheduled.seq_id)
        expected = seq.token_slice(0, scheduled.context_len)
        if pending is not None:
            assert expected[-1] == PLACEHOLDER_TOKEN, f"seq {seq.seq_id}"
            expected[-1] = pending
        assert context == expected, f"seq {seq.seq_id}"
        spec = scheduled.sample
        sampled = [
            SampledToken(next_token(spec.prompt_token_ids, seed, spec.output_index))
            for seed in spec.seeds
        ]
        if spec.sampling_params.logprobs is not None:
            for token in sampled:
                token.logprob, token.top_logprobs = -0.5, [(token.token_id, -0.5)]
        return sampled


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    eos_token_ids: tuple[int, ...] = (),
    enable_prefix_cache: bool = False,
    scheduling_policy: str = "fcfs",
    tier: KVTier | None = None,
    **options: Any,
) -> tuple[Scheduler, SimulatedRunner]:
    """A Scheduler over a KVCacheManager of `num_blocks` blocks of BLOCK_SIZE tokens (with a
    second `tier` if given), and its simulated runner. `options`: other Scheduler keyword
    arguments (fair_share_prefill_tokens, clock...)."""
    pool = BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    manager = KVCacheManager(pool, enable_prefix_cache=enable_prefix_cache, tier=tier)
    scheduler = Scheduler(
        manager,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        eos_token_ids,
        weights_version="w0",
        scheduling_policy=scheduling_policy,
        **options,
    )
    return scheduler, SimulatedRunner(scheduler)
