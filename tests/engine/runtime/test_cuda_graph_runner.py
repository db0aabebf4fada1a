"""CUDA-graph decode path, checked on the CPU: sizes, padding, static buffers, runner glue.

Only torch.cuda.graph itself needs a GPU (tests/integration/test_gpu_engine.py). Here the
padded static-buffer forward runs through the Triton interpreter, in a fresh process with
TRITON_INTERPRET=1 (triton picks the interpreter when it is imported), and "graphs" are
replayed eagerly: replay() re-runs exactly the computation a CUDA graph would record.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.core.batch import SampleSpec, ScheduledSeq, SchedulerOutput
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.runtime.cuda_graph_runner import (
    CudaGraphRunner,
    DecodeBuffers,
    DecodeRows,
    build_decode_rows,
    capture_sizes,
    graphs_disabled_reason,
    padded_size,
)
from engine.runtime.model_runner import ModelRunner
from engine.runtime.step_inputs import prepare_inputs
from tests.oracle import random_prompt

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = torch.device("cpu")
BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
_CHILD = "KVSHARE_GRAPH_TEST_CHILD"  # set in the fresh TRITON_INTERPRET=1 process
IN_CHILD = os.environ.get(_CHILD) == "1"
interpreted = pytest.mark.skipif(
    not IN_CHILD, reason="runs in a fresh TRITON_INTERPRET=1 process (test_interpreted_*)"
)


# -- sizes and reasons ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (16, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
        (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]),
    ],
)
def test_capture_sizes(max_num_seqs: int, expected: list[int]) -> None:
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_stop_at_512() -> None:
    sizes = capture_sizes(4096)
    assert sizes[-3:] == [480, 496, 512] and len(sizes) == 3 + 4 + 30
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0)


@pytest.mark.parametrize(
    ("num_seqs", "expected"), [(1, 1), (2, 2), (3, 4), (5, 8), (17, 24), (64, 64), (65, None)]
)
def test_padded_size(num_seqs: int, expected: int | None) -> None:
    assert padded_size(num_seqs, capture_sizes(64)) == expected


@pytest.mark.parametrize(
    ("enforce_eager", "device", "backend", "expected"),
    [
        (False, "cuda", "triton", None),
        (True, "cuda", "triton", "enforce_eager is set"),
        (False, "cuda", "torch", "attention backend 'torch' cannot be captured (only triton)"),
        (False, "cpu", "triton", "device is cpu, not cuda"),
        (False, "cpu", "torch", "device is cpu, not cuda"),
    ],
)
def test_graphs_disabled_reason(enforce_eager, device, backend, expected) -> None:
    assert graphs_disabled_reason(enforce_eager, torch.device(device), backend) == expected


# -- rows and buffers ----------------------------------------------------------------------
def decode(seq_id: int, token: int, position: int, block_ids: list[int]) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [token], position, block_ids, SampleSpec(GREEDY, [0], 0, [], []))


def decode_step(seqs: list[ScheduledSeq], block_size: int = 4) -> SchedulerOutput:
    slots = [
        s.block_ids[s.start_pos // block_size] * block_size + s.start_pos % block_size for s in seqs
    ]
    return SchedulerOutput(seqs=seqs, slot_mapping=slots, num_decodes=len(seqs))


# block_size 4: A at position 5 (2 blocks), B at 0 (1 block), C at 8 (3 of its 4 blocks used)
THREE_DECODES = [
    decode(10, 11, 5, [7, 3]),
    decode(20, 12, 0, [9]),
    decode(30, 13, 8, [1, 2, 5, 6]),
]
THREE_ROWS = DecodeRows(
    input_ids=[11, 12, 13, 0],
    positions=[5, 0, 8, 0],
    slot_mapping=[13, 36, 20, -1],
    seq_lens=[6, 1, 9, 0],
    tables=[[7, 3], [9], [1, 2, 5]],
    max_seq_len=9,
)


def test_decode_rows_are_padded_exactly() -> None:
    assert build_decode_rows(decode_step(THREE_DECODES), 4, 4) == THREE_ROWS
    unpadded = build_decode_rows(decode_step(THREE_DECODES[:2]), 2, 4)
    assert (unpadded.slot_mapping, unpadded.tables) == ([13, 36], [[7, 3], [9]])
    assert unpadded.table_width == 2


@pytest.mark.parametrize(
    ("step", "batch_size", "message"),
    [
        (decode_step(THREE_DECODES), 2, "cannot pad 3 sequences to a batch of 2"),
        (SchedulerOutput(), 4, "cannot pad 0 sequences"),
        (
            SchedulerOutput([ScheduledSeq(1, [5, 6], 0, [0])], [0, 1], num_decodes=0),
            4,
            "exactly one token and one slot per sequence",
        ),
        (
            SchedulerOutput([decode(1, 5, 3, [0])], [3, 4], num_decodes=1),
            4,
            "exactly one token and one slot per sequence",
        ),
        (SchedulerOutput([decode(1, 5, 4, [0])], [4], 1), 4, "has 1 blocks for 5 tokens"),
    ],
)
def test_decode_rows_refuse_malformed_steps(step, batch_size, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_decode_rows(step, batch_size, 4)


def test_fresh_buffers_hold_padding_and_load_overwrites_leading_rows() -> None:
    buffers = DecodeBuffers(max_batch_size=6, max_blocks_per_seq=5, device=CPU)
    assert buffers.slot_mapping.tolist() == [-1] * 6 and buffers.seq_lens.tolist() == [0] * 6
    assert buffers.query_start_loc.tolist() == list(range(7))
    buffers.load(THREE_ROWS)
    assert buffers.input_ids.tolist() == [11, 12, 13, 0, 0, 0]
    assert buffers.positions.tolist() == [5, 0, 8, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [13, 36, 20, -1, -1, -1]
    assert buffers.seq_lens.tolist() == [6, 1, 9, 0, 0, 0]
    assert buffers.block_tables.tolist() == [
        [7, 3, 0, 0, 0], [9, 0, 0, 0, 0], [1, 2, 5, 0, 0], *[[0] * 5] * 3
    ]  # fmt: skip
    # A smaller step rewrites its rows and the table entries that changed only; the rest is
    # never read (rows past the batch, a padding row's table, columns past each row's seq_len).
    buffers.load(build_decode_rows(decode_step([decode(40, 14, 2, [4])]), 2, 4))
    assert buffers.input_ids.tolist() == [14, 0, 13, 0, 0, 0]
    assert buffers.slot_mapping.tolist() == [18, -1, 20, -1, -1, -1]
    assert buffers.seq_lens.tolist() == [3, 0, 9, 0, 0, 0]
    assert buffers.block_tables[:3].tolist() == [[4, 3, 0, 0, 0], [9, 0, 0, 0, 0], [1, 2, 5, 0, 0]]
    assert buffers.table_writes == 1


def load_tables(buffers: DecodeBuffers, tables: list[list[int]]) -> int:
    """Load a decode step whose rows read `tables`; the table entries the load sent."""
    rows = DecodeRows(
        input_ids=[1] * len(tables), positions=[0] * len(tables), slot_mapping=[0] * len(tables),
        seq_lens=[len(t) * 4 for t in tables], tables=tables, max_seq_len=4 * max(map(len, tables)),
    )  # fmt: skip
    buffers.load(rows)
    for row, table in enumerate(tables):  # what the kernels read is the step's tables
        assert buffers.block_tables[row, : len(table)].tolist() == table
    return buffers.table_writes


def test_block_tables_stay_on_the_device_and_only_changes_are_sent() -> None:
    buffers = DecodeBuffers(max_batch_size=4, max_blocks_per_seq=6, device=CPU)
    assert load_tables(buffers, [[1, 2], [3]]) == 3  # first step: every entry
    assert load_tables(buffers, [[1, 2], [3]]) == 0  # the next steps within the same blocks
    assert load_tables(buffers, [[1, 2, 4], [3]]) == 1  # a sequence crossed into a new block
    assert load_tables(buffers, [[1, 2, 9], [3]]) == 1  # copy-on-write swapped its last block
    assert load_tables(buffers, [[3], [1, 2, 9]]) == 4  # the rows swapped sequences
    assert load_tables(buffers, [[3]]) == 0  # a smaller batch: row 1 is padding, unread
    assert load_tables(buffers, [[3], [1, 2, 9], [5, 6]]) == 2  # row 1 still held its table
    assert load_tables(buffers, [[7, 2]]) == 2  # another sequence, sharing a block id


def test_incremental_block_tables_equal_a_full_rebuild() -> None:
    """Random steps (growth, copy-on-write swaps, finished and new sequences, reordering):
    after each, the device rows hold the step's tables, as rebuilding them whole would."""
    rng = random.Random(5)
    buffers = DecodeBuffers(max_batch_size=8, max_blocks_per_seq=12, device=CPU)
    live = [[rng.randrange(100)] for _ in range(5)]
    sent = whole = 0
    for _ in range(300):
        for table in live:
            change = rng.random()
            if change < 0.2 and len(table) < 12:
                table.append(rng.randrange(100))
            elif change < 0.25:
                table[-1] = rng.randrange(100)
        if rng.random() < 0.1:
            live.pop(rng.randrange(len(live)))
        if rng.random() < 0.15 and len(live) < 8:
            live.insert(rng.randrange(len(live) + 1), [rng.randrange(100)])
        if not live:
            live.append([rng.randrange(100)])
        sent += load_tables(buffers, [list(t) for t in live])
        whole += sum(map(len, live))
    assert sent < whole / 3, (sent, whole)  # far fewer than resending every table each step


def test_buffers_refuse_rows_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="4 rows x 3 blocks do not fit buffers of 3 x 5"):
        DecodeBuffers(3, 5, CPU).load(THREE_ROWS)
    with pytest.raises(ValueError, match="4 rows x 3 blocks do not fit buffers of 8 x 2"):
        DecodeBuffers(8, 2, CPU).load(THREE_ROWS)


def test_metadata_views_the_buffers() -> None:
    buffers = DecodeBuffers(6, 5, CPU)
    meta = buffers.metadata(4, max_seq_len=40)
    for view, whole in [
        (meta.slot_mapping, buffers.slot_mapping),
        (meta.seq_lens, buffers.seq_lens),
        (meta.block_tables, buffers.block_tables),
        (meta.query_start_loc, buffers.query_start_loc),
    ]:
        assert view.data_ptr() == whole.data_ptr()  # a graph reads what load() writes
    assert meta.block_tables.shape == (4, 5) and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert (meta.num_seqs, meta.num_decodes, meta.max_query_len, meta.max_seq_len) == (4, 4, 1, 40)


# -- the runner without CUDA ---------------------------------------------------------------
class StubBackend:
    """choose_num_splits shaped like Triton's: more splits for longer contexts, fewer for
    bigger batches, powers of two."""

    name = "triton"

    def choose_num_splits(self, num_decodes, num_kv_heads, max_seq_len, device) -> int:
        wanted = max(1, min(8, max_seq_len // 32) // num_decodes)
        return 1 << (wanted.bit_length() - 1)


class CountingGraph:
    def __init__(self) -> None:
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1


def stub_graph_runner(max_num_seqs: int = 6) -> CudaGraphRunner:
    kv_caches = [(torch.zeros(16, 4, 2, 8), torch.zeros(16, 4, 2, 8))]
    return CudaGraphRunner(
        torch.nn.Identity(), kv_caches, StubBackend(),
        block_size=4, max_model_len=128, max_num_seqs=max_num_seqs,
    )  # fmt: skip


def test_runner_keys_graphs_by_padded_size_and_split_count() -> None:
    runner = stub_graph_runner()
    assert runner.sizes == [1, 2, 4, 6] and runner.buffers.block_tables.shape == (6, 32)
    assert [runner.split_counts(size) for size in runner.sizes] == [[1, 2, 4], [1, 2], [1], [1]]
    assert runner.load(decode_step(THREE_DECODES)) == (4, 1)
    assert runner.buffers.slot_mapping[:4].tolist() == THREE_ROWS.slot_mapping
    assert runner.load(decode_step([decode(1, 7, 100, list(range(26)))])) == (1, 2)
    assert runner.buffers.seq_lens[:1].tolist() == [101]


def test_runner_replays_only_decode_only_steps_that_fit() -> None:
    runner = stub_graph_runner()
    step = decode_step(THREE_DECODES)
    assert not runner.can_replay(step)  # nothing captured yet
    graph = CountingGraph()
    runner.graphs[(4, 1)] = graph
    runner.outputs[(4, 1)] = torch.arange(8.0).view(4, 2)
    mixed = SchedulerOutput(step.seqs, step.slot_mapping, num_decodes=2)
    seven = decode_step([decode(i, 1, 0, [i]) for i in range(7)])
    assert runner.can_replay(step)
    assert not any(runner.can_replay(s) for s in (mixed, seven, SchedulerOutput()))
    assert runner.replay(step).tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert (graph.num_replays, runner.num_replays) == (1, 1)


# -- ModelRunner glue, on the CPU with the torch backend -----------------------------------
def make_runner(model_dir, **overrides) -> ModelRunner:
    settings = {"model": str(model_dir), "block_size": BLOCK_SIZE, "num_kv_blocks": 64}
    return ModelRunner(EngineConfig(**{**settings, **overrides}))


@dataclass
class Seq:
    seq_id: int
    prompt: list[int]
    block_ids: list[int]
    output: list[int] = field(default_factory=list)

    def scheduled(self, is_decode: bool) -> ScheduledSeq:
        spec = SampleSpec(GREEDY, [0], len(self.output), self.prompt, self.output)
        if not is_decode:
            return ScheduledSeq(self.seq_id, self.prompt, 0, self.block_ids, spec)
        position = len(self.prompt) + len(self.output) - 1
        return ScheduledSeq(self.seq_id, self.output[-1:], position, self.block_ids, spec)


PROMPTS = [random_prompt(5, 0), random_prompt(13, 1), random_prompt(21, 2), random_prompt(9, 3)]
ARRIVALS = [0, 0, 0, 2]  # prompt 3 joins at step 2: that step mixes decodes and a prefill
NUM_NEW = 6
# decode-only steps: 1 (3 seqs), 3-5 (4 seqs), 6-7 (prompt 3 alone)
DECODE_ONLY_BATCHES = [3, 4, 4, 4, 1, 1]


def generate(runner: ModelRunner, make_step) -> list[list[int]]:
    """Greedy NUM_NEW tokens per prompt: prompt i is prefilled whole at step ARRIVALS[i],
    then decodes one token per step (decodes first in each step); fresh blocks per prompt."""
    seqs: list[Seq] = []
    step = 0
    while len(seqs) < len(PROMPTS) or any(len(s.output) < NUM_NEW for s in seqs):
        decodes = [s for s in seqs if len(s.output) < NUM_NEW]
        prefills = []
        for i in (i for i, arrival in enumerate(ARRIVALS) if arrival == step):
            first_block = sum(len(s.block_ids) for s in seqs)
            num_blocks = -(-(len(PROMPTS[i]) + NUM_NEW) // BLOCK_SIZE)
            prefills.append(Seq(i, PROMPTS[i], list(range(first_block, first_block + num_blocks))))
            seqs.append(prefills[-1])
        scheduled = [s.scheduled(True) for s in decodes] + [s.scheduled(False) for s in prefills]
        out = runner.execute(make_step(scheduled, BLOCK_SIZE, num_decodes=len(decodes)))
        for seq in decodes + prefills:
            seq.output.append(out.sampled[seq.seq_id][0].token_id)
        step += 1
    return [seq.output for seq in sorted(seqs, key=lambda s: s.seq_id)]


def prefill_three(runner: ModelRunner, make_step) -> list[Seq]:
    """Prefill prompts 0-2 in one step (3 blocks each); each ends with its first token."""
    seqs = [Seq(i, PROMPTS[i], [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(3)]
    out = runner.execute(make_step([s.scheduled(False) for s in seqs], BLOCK_SIZE))
    for seq in seqs:
        seq.output.append(out.sampled[seq.seq_id][0].token_id)
    return seqs


class EagerReplayer:
    """Stands in for CudaGraphRunner: 'replays' a decode-only step by running it eagerly."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.batch_sizes: list[int] = []

    def can_replay(self, sched_out: SchedulerOutput) -> bool:
        return 0 < len(sched_out.seqs) == sched_out.num_decodes

    def head_outputs(self, num_rows: int) -> None:
        return None  # the runner computes the logits from the hidden rows

    def replay(self, sched_out: SchedulerOutput, tokens: torch.Tensor | None) -> torch.Tensor:
        self.batch_sizes.append(len(sched_out.seqs))
        inputs = prepare_inputs(sched_out, CPU)
        if tokens is not None:  # a lookahead step's input tokens, its rows first
            inputs.input_ids[: tokens.shape[0]] = tokens
        runner = self.runner
        return runner.model(
            inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, runner.attn_backend
        )  # [B, E], every row


def test_cpu_runner_has_no_graphs(tiny_llama_dir) -> None:
    assert make_runner(tiny_llama_dir).graph_runner is None
    assert make_runner(tiny_llama_dir, enforce_eager=True).graph_runner is None


def test_decode_only_steps_take_the_graph_path_and_sample_the_same(tiny_llama_dir, make_step):
    expected = generate(make_runner(tiny_llama_dir), make_step)
    runner = make_runner(tiny_llama_dir)
    runner.graph_runner = replayer = EagerReplayer(runner)
    assert generate(runner, make_step) == expected
    assert replayer.batch_sizes == DECODE_ONLY_BATCHES


def test_graph_path_samples_only_rows_with_a_sample_spec(tiny_llama_dir, make_step):
    runner = make_runner(tiny_llama_dir)
    seqs = prefill_three(runner, make_step)
    decodes = [s.scheduled(True) for s in seqs]
    eager = runner.execute(make_step(decodes, BLOCK_SIZE, num_decodes=3)).sampled
    decodes[1].sample = None
    runner.graph_runner = EagerReplayer(runner)
    graph = runner.execute(make_step(decodes, BLOCK_SIZE, num_decodes=3)).sampled
    assert runner.graph_runner.batch_sizes == [3]
    assert graph == {0: eager[0], 2: eager[2]}


def test_sizing_warm_up_is_one_valid_step_sampling_a_full_batch(tiny_llama_dir, monkeypatch):
    runner = make_runner(tiny_llama_dir, max_num_seqs=4)
    steps: list[SchedulerOutput] = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda step: steps.append(step) or execute(step))
    runner._warm_up(23)  # the CUDA sizing pass, run here on the CPU
    [step] = steps
    assert [s.num_tokens for s in step.seqs] == [20, 1, 1, 1]  # the longest attention
    assert [s.block_ids for s in step.seqs] == [[0, 1, 2], [3], [4], [5]]
    assert step.slot_mapping == [*range(20), 24, 32, 40]
    assert all(s.sample.sampling_params.top_p == 0.9 for s in step.seqs)
    assert not hasattr(runner, "kv_caches")  # the temporary pool is gone


# -- the padded static forward through the Triton interpreter (fresh process) --------------
def test_triton_interpreter_checks_in_fresh_process() -> None:
    if IN_CHILD:
        pytest.skip("this is the fresh process")
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted",
         __file__],
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ, "TRITON_INTERPRET": "1", _CHILD: "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary  # they ran, all of them


class EagerGraph:
    """A CUDA graph's contract without CUDA: replay re-runs the recorded computation, which
    reads the static buffers as they are now and writes the same output tensor."""

    def __init__(self, graph_runner: CudaGraphRunner, key: tuple[int, int]) -> None:
        self.graph_runner, self.key = graph_runner, key

    def replay(self) -> None:
        fresh = self.graph_runner.run_static(*self.key)
        self.graph_runner.outputs[self.key].copy_(fresh)


def emulate_capture(runner: ModelRunner) -> CudaGraphRunner:
    graph_runner = CudaGraphRunner(
        runner.model, runner.kv_caches, runner.attn_backend,
        block_size=runner.block_size, max_model_len=runner.max_model_len,
        max_num_seqs=runner.config.max_num_seqs,
    )  # fmt: skip
    with torch.inference_mode():
        for size in graph_runner.sizes:
            for num_splits in graph_runner.split_counts(size):
                graph_runner.outputs[(size, num_splits)] = graph_runner.run_static(size, num_splits)
                graph_runner.graphs[(size, num_splits)] = EagerGraph(
                    graph_runner, (size, num_splits)
                )
    return graph_runner


@interpreted
def test_interpreted_replayed_decodes_match_the_torch_reference(tiny_llama_dir, make_step):
    expected = generate(make_runner(tiny_llama_dir), make_step)  # torch backend, eager
    runner = make_runner(tiny_llama_dir, attention_backend="triton", max_num_seqs=4)
    assert runner.attn_backend.name == "triton" and runner.graph_runner is None  # CPU
    pool_before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.graph_runner = emulate_capture(runner)
    for (k, v), (k0, v0) in zip(runner.kv_caches, pool_before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)  # capturing wrote no KV
    outputs = generate(runner, make_step)
    assert runner.graph_runner.num_replays == len(DECODE_ONLY_BATCHES)
    assert outputs == expected  # sampled from the graphs' own logits and argmax


@interpreted
def test_interpreted_lookahead_steps_read_the_graphs_tokens(tiny_llama_dir):
    """Async scheduling over replayed graphs: a lookahead step's input tokens are the graph
    before it's argmax or draws, read on the device before the next replay overwrites the
    static outputs; the text is the synchronous steps'."""
    from engine.llm_engine import LLMEngine
    from tests.engine.test_async_scheduling import count_lookaheads

    settings = {"model": str(tiny_llama_dir), "block_size": BLOCK_SIZE, "num_kv_blocks": 64}
    settings.update(attention_backend="triton", max_num_seqs=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=7, ignore_eos=True)
    batches = [[greedy] * 3, [greedy, sampled, greedy]]  # argmax in the graph; the sampler
    texts, num_lookaheads = {}, {}
    for mode in ("off", "on"):
        engine = LLMEngine(EngineConfig(**settings, async_scheduling=mode))
        engine.runner.graph_runner = emulate_capture(engine.runner)
        lookaheads = count_lookaheads(engine)
        texts[mode] = [[r.token_ids for r in engine.generate(PROMPTS[:3], p)] for p in batches]
        num_lookaheads[mode] = len(lookaheads)
        assert engine.runner.graph_runner.num_replays == 2 * 6  # every decode step
    assert texts["on"] == texts["off"]
    assert num_lookaheads == {"off": 0, "on": 2 * 5}  # each decode step but the first


@interpreted
def test_interpreted_graph_head_equals_the_eager_head(tiny_llama_dir, make_step):
    """The logits and greedy tokens a graph records are the eager head's on the same rows,
    and a sampled (non-greedy) step reads those logits."""
    runner = make_runner(tiny_llama_dir, attention_backend="triton", max_num_seqs=4)
    seqs = prefill_three(runner, make_step)
    step = make_step([s.scheduled(True) for s in seqs], BLOCK_SIZE, num_decodes=3)
    graph_runner = emulate_capture(runner)
    with torch.inference_mode():
        hidden = graph_runner.replay(step)  # [3, E]
        logits, greedy = graph_runner.head_outputs(3)
        eager_logits = runner.model.compute_logits(hidden)
    assert torch.equal(logits, eager_logits)
    assert greedy.tolist() == eager_logits.argmax(dim=-1).tolist()
    assert graph_runner.logits.shape[0] == graph_runner.sizes[-1]


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2])
def test_interpreted_padded_forward_matches_eager_and_spares_the_pool(
    tiny_llama_dir, make_step, num_splits
):
    runner = make_runner(tiny_llama_dir, attention_backend="triton", max_num_seqs=4)
    seqs = prefill_three(runner, make_step)
    step = make_step([s.scheduled(True) for s in seqs], BLOCK_SIZE, num_decodes=3)
    inputs = prepare_inputs(step, CPU)
    with torch.inference_mode():
        eager = runner.model(
            inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, runner.attn_backend
        )  # [3, E]
        pool = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        graph_runner = emulate_capture(runner)
        assert graph_runner.load(step) == (4, 1)
        padded = graph_runner.run_static(4, num_splits)  # [4, E]
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded[3]).all()
    real = torch.zeros(runner.num_kv_blocks * BLOCK_SIZE, dtype=torch.bool)
    real[step.slot_mapping] = True
    caches = [cache for pair in runner.kv_caches for cache in pair]
    for cache, before in zip(caches, [c for pair in pool for c in pair], strict=True):
        flat, flat_before = cache.view(real.shape[0], -1), before.view(real.shape[0], -1)
        assert torch.equal(flat[~real], flat_before[~real])  # the padding row wrote nothing
        torch.testing.assert_close(flat[real], flat_before[real], atol=1e-5, rtol=1e-5)
