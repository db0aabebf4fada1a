"""ModelRunner driven by hand-built SchedulerOutputs; HF generate is the oracle."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.batch import BlockCopy, SampleSpec, ScheduledSeq, SchedulerOutput
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.runtime.model_runner import ModelRunner, kv_bytes_per_token
from engine.runtime.step_inputs import prepare_inputs
from tests import oracle
from tests.oracle import random_prompt

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def make_runner(model_dir, **overrides) -> ModelRunner:
    settings = {"model": str(model_dir), "block_size": BLOCK_SIZE, "num_kv_blocks": 64}
    return ModelRunner(EngineConfig(**{**settings, **overrides}))


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return oracle.hf_greedy(hf, prompt, max_new_tokens)


@dataclass
class Seq:
    seq_id: int
    prompt: list[int]
    params: SamplingParams = GREEDY
    seed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class MiniScheduler:
    """The scheduler's job in miniature: decodes first, then prefill chunks, fresh blocks."""

    def __init__(self, runner: ModelRunner, chunk: int, first_free_block: int = 0) -> None:
        self.runner, self.chunk, self.next_block = runner, chunk, first_free_block

    def step(self, seqs: list[Seq], make_step) -> None:
        decodes = [s for s in seqs if s.num_computed == len(s.tokens) - 1 and s.output]
        prefills = [s for s in seqs if s not in decodes and s.num_computed < len(s.tokens)]
        scheduled = [self._schedule(s, 1) for s in decodes]
        scheduled += [self._schedule(s, self.chunk) for s in prefills]
        out = self.runner.execute(make_step(scheduled, BLOCK_SIZE, num_decodes=len(decodes)))
        for seq, sched in zip(decodes + prefills, scheduled, strict=True):
            seq.num_computed += sched.num_tokens
            if sched.sample is not None:
                seq.output.append(out.sampled[seq.seq_id][0].token_id)

    def _schedule(self, seq: Seq, budget: int) -> ScheduledSeq:
        token_ids = seq.tokens[seq.num_computed : seq.num_computed + budget]
        end = seq.num_computed + len(token_ids)
        while len(seq.block_ids) * BLOCK_SIZE < end:
            seq.block_ids.append(self.next_block)
            self.next_block += 1
        sample = None
        if end == len(seq.tokens):
            sample = SampleSpec(seq.params, [seq.seed], len(seq.output), seq.prompt, seq.output)
        return ScheduledSeq(seq.seq_id, token_ids, seq.num_computed, list(seq.block_ids), sample)


def run_until(scheduler: MiniScheduler, seqs: list[Seq], num_new: int, make_step) -> None:
    while any(len(s.output) < num_new for s in seqs):
        scheduler.step([s for s in seqs if len(s.output) < num_new], make_step)


def test_greedy_decoding_matches_hf_generate(tiny_llama_dir, make_step):
    runner = make_runner(tiny_llama_dir)
    # With the native CPU library, greedy rows take its argmax: HF's tokens are the check.
    assert (runner.sampler.argmax is not None) == (runner.attn_backend.name == "cpu")
    seqs = [Seq(0, random_prompt(5, 0)), Seq(1, random_prompt(13, 1)), Seq(2, random_prompt(21, 2))]
    scheduler = MiniScheduler(runner, chunk=6)
    scheduler.step(seqs[:1], make_step)  # seq 0 starts early: later steps mix decode + prefill
    run_until(scheduler, seqs, 10, make_step)
    for seq in seqs:
        assert seq.output == hf_greedy(tiny_llama_dir, seq.prompt, 10)


def test_shared_prefix_and_copy_on_write_match_hf(tiny_llama_dir, make_step):
    runner = make_runner(tiny_llama_dir)
    scheduler = MiniScheduler(runner, chunk=32)
    base = random_prompt(12, 3)  # fills block 0 and half of block 1
    owner = Seq(0, base)
    scheduler.step([owner], make_step)
    # A second sequence reuses block 0 as is and a private copy (block 5) of the partial block 1.
    follower = Seq(1, base + random_prompt(6, 4), block_ids=[0, 5], num_computed=12)
    scheduler.next_block = 6
    copy_step = make_step([], BLOCK_SIZE, block_copies=[BlockCopy(src=1, dst=5)])
    assert runner.execute(copy_step).sampled == {}
    run_until(scheduler, [owner, follower], 8, make_step)
    assert owner.block_ids[:2] == [0, 1] and follower.block_ids[:2] == [0, 5]
    assert owner.output == hf_greedy(tiny_llama_dir, owner.prompt, 8)
    assert follower.output == hf_greedy(tiny_llama_dir, follower.prompt, 8)


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama_dir, make_step):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64)
    alone = Seq(0, random_prompt(9, 5), params, seed=1234)
    run_until(MiniScheduler(make_runner(tiny_llama_dir), chunk=4), [alone], 8, make_step)
    crowd = [Seq(i, random_prompt(4 + 3 * i, 10 + i), params, seed=i) for i in range(1, 4)]
    again = Seq(0, alone.prompt, params, seed=1234)
    scheduler = MiniScheduler(make_runner(tiny_llama_dir), chunk=7)
    scheduler.step(crowd, make_step)
    run_until(scheduler, [*crowd, again], 8, make_step)
    assert again.output == alone.output


def test_prefill_chunk_without_sample_returns_nothing_and_empty_step_is_a_no_op(
    tiny_llama_dir, make_step
):
    runner = make_runner(tiny_llama_dir)
    chunk = ScheduledSeq(0, random_prompt(5, 6), 0, [0])
    assert runner.execute(make_step([chunk], BLOCK_SIZE)).sampled == {}
    assert runner.execute(SchedulerOutput()).sampled == {}


def test_step_past_the_context_window_is_refused(make_tiny_model, make_step):
    runner = make_runner(make_tiny_model(), max_model_len=16)
    too_long = ScheduledSeq(0, random_prompt(17, 7), 0, [0, 1, 2])
    with pytest.raises(ValueError, match="past max_model_len 16"):
        runner.execute(make_step([too_long], BLOCK_SIZE))


def test_step_with_too_few_blocks_is_refused(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    short_table = ScheduledSeq(0, random_prompt(9, 7), 0, [0])
    step = SchedulerOutput(seqs=[short_table], slot_mapping=list(range(9)))
    with pytest.raises(ValueError, match="has 1 blocks for 9 tokens"):
        runner.execute(step)


def test_prepare_inputs_flattens_the_batch_exactly(make_step):
    greedy = SampleSpec(GREEDY, [0], 0, [], [])
    seqs = [
        ScheduledSeq(4, [11], 9, [3, 7], greedy),  # a decode at position 9
        ScheduledSeq(5, [12, 13, 14], 0, [2]),  # a prefill chunk that samples nothing
        ScheduledSeq(6, [15, 16], 16, [0, 1, 5], greedy),  # a chunk after 16 cached tokens
    ]
    inputs = prepare_inputs(make_step(seqs, BLOCK_SIZE, num_decodes=1), torch.device("cpu"))
    assert inputs.input_ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert inputs.positions.tolist() == [9, 0, 1, 2, 16, 17]
    meta = inputs.meta
    assert meta.slot_mapping.tolist() == [57, 16, 17, 18, 40, 41]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_host == [0, 1, 4, 6]
    assert meta.seq_lens.tolist() == meta.seq_lens_host == [10, 3, 18]
    assert meta.block_tables.tolist() == [[3, 7, 0], [2, 0, 0], [0, 1, 5]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert (meta.num_decodes, meta.max_seq_len, meta.max_query_len) == (1, 18, 3)
    assert inputs.logits_indices.tolist() == [0, 5]
    assert inputs.sample_seq_ids == [4, 6]


def test_tile_rows_mark_prompt_tokens_by_position_whatever_the_step(make_step):
    """A token's path is its own: prompt positions (< prompt_len) 1, generated ones 0, in a
    decode, a first chunk, a chunk that recomputes a prompt and its answer (preemption), and a
    continuation past the prompt; zeros without a prompt token, None when not asked for."""
    seqs = [
        ScheduledSeq(4, [11], 9, [3, 7], prompt_len=5),  # a decode
        ScheduledSeq(5, [12, 13, 14], 0, [2], prompt_len=8),  # a first chunk
        ScheduledSeq(6, [15, 16, 17, 18], 0, [0], prompt_len=2),  # prompt + answer again
        ScheduledSeq(7, [19, 20], 16, [0, 1, 5], prompt_len=17),  # the prompt's end, then 1
    ]
    step = make_step(seqs, BLOCK_SIZE, num_decodes=1)
    cpu = torch.device("cpu")
    tiles = prepare_inputs(step, cpu, tile_prompts=True).meta.tile_rows
    assert tiles.dtype == torch.int32
    assert tiles.tolist() == [0, 1, 1, 1, 1, 1, 0, 0, 1, 0]
    assert prepare_inputs(step, cpu).meta.tile_rows is None
    decodes = make_step(seqs[:1], BLOCK_SIZE, num_decodes=1)
    assert prepare_inputs(decodes, cpu, tile_prompts=True).meta.tile_rows.tolist() == [0]


def test_kv_pool_sized_from_bytes_and_described(tiny_llama_dir):
    # 2 (K, V) * 2 layers * 2 KV heads * 16 head dim * 4 bytes = 512 bytes per token.
    bytes_per_block = BLOCK_SIZE * 512
    runner = make_runner(
        tiny_llama_dir, num_kv_blocks=None, kv_cache_bytes=10 * bytes_per_block + 5
    )
    assert (runner.bytes_per_block, runner.num_kv_blocks) == (bytes_per_block, 10)
    assert len(runner.kv_caches) == 2
    assert all(k.shape == (10, BLOCK_SIZE, 2, 16) for k, _ in runner.kv_caches)
    info = runner.model_info
    assert (info.name, info.max_model_len, info.vocab_size) == (tiny_llama_dir.name, 256, 256)
    assert info.eos_token_ids == (2,) and info.tokenizer_path == str(tiny_llama_dir)


def test_bfloat16_runner_decodes(tiny_llama_dir, make_step):
    runner = make_runner(tiny_llama_dir, dtype="bfloat16")
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    seq = Seq(0, random_prompt(11, 8))
    run_until(MiniScheduler(runner, chunk=16), [seq], 6, make_step)
    expected = hf_greedy(tiny_llama_dir, seq.prompt, 6)
    assert sum(a == b for a, b in zip(seq.output, expected, strict=True)) >= 3


@pytest.mark.parametrize(
    ("overrides", "kv_dtype"),
    [
        ({}, torch.float32),  # auto, exact weights: the model's own dtype
        ({"kv_cache_dtype": "float16"}, torch.float16),
        ({"kv_cache_dtype": "bfloat16"}, torch.bfloat16),
    ],
    ids=["auto", "float16", "bfloat16"],
)
def test_kv_cache_dtype_sets_the_pool_and_its_size(tiny_llama_dir, overrides, kv_dtype):
    # 2 (K, V) * 2 layers * 2 KV heads * 16 head dim * itemsize bytes per token: the same
    # bytes hold twice the blocks at 2 bytes an element.
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    bytes_per_block = BLOCK_SIZE * 2 * 2 * 2 * 16 * itemsize
    runner = make_runner(tiny_llama_dir, num_kv_blocks=None, kv_cache_bytes=40 * 1024, **overrides)
    assert runner.kv_dtype == kv_dtype and runner.dtype == torch.float32
    assert runner.bytes_per_block == bytes_per_block
    assert runner.num_kv_blocks == 40 * 1024 // bytes_per_block
    assert all(k.dtype == v.dtype == kv_dtype for k, v in runner.kv_caches)


def test_a_float16_kv_cache_decodes_like_hf(tiny_llama_dir, make_step):
    """fp32 model, fp16 K/V (rounded where stored, attention in fp32): greedy tokens as HF's."""
    runner = make_runner(tiny_llama_dir, kv_cache_dtype="float16")
    seqs = [Seq(i, random_prompt(9 + 4 * i, 20 + i)) for i in range(3)]
    run_until(MiniScheduler(runner, chunk=16), seqs, 8, make_step)
    for seq in seqs:
        assert seq.output == hf_greedy(tiny_llama_dir, seq.prompt, 8)


def test_kv_bytes_per_token_without_weights():
    smollm2 = SimpleNamespace(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        head_dim=64,
        vocab_size=49152,
        intermediate_size=1536,
        rms_norm_eps=1e-5,
        model_type="llama",
    )
    assert kv_bytes_per_token(smollm2, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(smollm2, "bfloat16") == 2 * 30 * 3 * 64 * 2
