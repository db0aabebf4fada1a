"""benchmarks/ab.py's engine-step subcommands: attention (the paged kernels), native-step (the
native layer stack against another tree's) and greedy-head (the greedy head on and off)."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

from benchmarks.ab_harness import (
    REPO,
    build_each,
    check_same_bits,
    interleave,
    medians,
    print_header,
    print_row,
    seconds_of,
)


def cpu_engine(model: str | None = None):
    """An engine of config/cpu.yaml (on `model`, a `kvshare serve --model` value, where given),
    drafting and the audit off."""
    from app.settings import load_settings
    from engine.llm_engine import LLMEngine

    config = load_settings(REPO / "config" / "cpu.yaml", environ={}).to_engine_config()
    config = dataclasses.replace(config, audit_sample_rate=0.0, speculative_ngram_tokens=0)
    if model is not None:
        config = dataclasses.replace(config, model=model)
    return LLMEngine(config)


def decode_in_turns(
    engine, switch, batch: int, steps: int, rng, prompt_tokens: int, tolerate: bool = False
) -> None:
    """`batch` fresh prompts of `prompt_tokens` decoded `steps` steps, switch.use() taking the
    variants in turn step by step (switch: a NativeSwitch or GreedyToggle). Its times are
    cleared first; times[name]["step"] holds each variant's steps after."""
    from profile_step import _is_decode_only

    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams

    ids = [f"ab-{batch}-{i}-{rng.randrange(10**9)}" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for request_id in ids:
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        engine.add_request(EngineRequest(request_id, prompt, params))
    while not _is_decode_only(engine, batch):  # every prompt prefilled: one token a sequence
        engine.step()
    switch.check_same_bits(engine, tolerate)
    for times in switch.times.values():
        for samples in times.values():
            samples.clear()

    def step_with(name: str) -> float:
        switch.use(name)
        return seconds_of(engine.step)

    variants = {name: partial(step_with, name) for name in switch.names}
    for name, samples in interleave(variants, steps // len(variants)).items():
        switch.times[name]["step"] = samples
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


# --- attention ----------------------------------------------------------------------------------


def attention(args: argparse.Namespace) -> int:
    """Native paged attention of two or more builds, the same KV, from memory.

    SmolLM2's shapes (30 layers, 9 query heads over 3 KV heads of 64, fp16 KV in 16-token blocks),
    the pool on huge pages as the CPU runner allocates it (engine/runtime/cpu/allocator.py), each
    sequence's blocks consecutive. Per batch size, every build (this tree's and each --base's) runs
    the 30 layers' kvshare_paged_decode (2 threads) once per round, each after a sweep of 128 MB (as
    in a step, where the weights have just passed through the caches). Outputs are compared first (a
    difference is printed). Prints, per build, the median over rounds and the KV bytes read over it.
    Then, per --chunks ROWS:CACHED, a prefill chunk of ROWS queries after CACHED cached tokens (each
    row a query at its own position, one sequence's blocks: after the first row, its context is in
    cache), the 30 layers without a sweep."""
    import torch
    from kv_pages import BLOCK, HEAD_DIM, HEADS, KV_HEADS, LAYERS

    from engine.runtime.cpu.allocator import zeros_on_huge_pages

    trees = {"this tree": REPO, **{str(base): base for base in args.base}}
    scratch = Path(tempfile.mkdtemp())
    libraries = build_each(trees, scratch, args.isa, ("kvshare_paged_decode",))
    blocks = -(-args.positions // BLOCK)
    pool = zeros_on_huge_pages(
        (2 * LAYERS, max(args.batches) * blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.float16
    )
    pool.normal_()
    sweep = torch.ones(32 * 1024 * 1024)

    print_header("batch", "build", "ms (30 layers)", "KV GB/s")
    for batch in args.batches:
        tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks).contiguous()
        # Lengths a little apart, as a batch's sequences are.
        seq_lens = torch.tensor(
            [args.positions - 7 * i % 40 for i in range(batch)], dtype=torch.int32
        )
        query = torch.randn(batch, HEADS, HEAD_DIM)
        inputs = (pool, query, [tables] * LAYERS, seq_lens)
        times = _attention_in_turns(libraries, inputs, args.rounds, f"batch {batch}", sweep)
        kv_bytes = 2 * LAYERS * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 2
        for name, seconds in times.items():
            print_row(batch, name, f"{1000 * seconds:.3f}", f"{kv_bytes / seconds / 1e9:.1f}")

    if args.chunks:
        print()
        print_header("chunk (rows after cached)", "build", "ms (30 layers)")
    for chunk in args.chunks:
        rows, cached = (int(part) for part in chunk.split(":"))
        blocks = -(-(cached + rows) // BLOCK)
        pool = torch.randn(2 * LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM).to(torch.float16)
        tables = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1).contiguous()
        seq_lens = torch.arange(cached + 1, cached + rows + 1, dtype=torch.int32)
        inputs = (pool, torch.randn(rows, HEADS, HEAD_DIM), [tables] * LAYERS, seq_lens)
        times = _attention_in_turns(libraries, inputs, args.rounds, f"chunk {chunk}", None)
        for name, seconds in times.items():
            print_row(f"{rows} after {cached}", name, f"{1000 * seconds:.2f}")
    return 0


def _attention_in_turns(libraries, inputs, rounds: int, label: str, sweep) -> dict[str, float]:
    """Each build's median seconds (each call after a sweep of the caches when `sweep` is
    given); their outputs compared first."""
    import torch
    from kv_pages import run_layers

    outs = {name: torch.empty_like(inputs[1]) for name in libraries}
    for name, library in libraries.items():
        run_layers(library, *inputs, outs[name])
    check_same_bits(outs, label, tolerate=True)

    def call(name: str) -> float:
        if sweep is not None:
            sweep.sum()
        return run_layers(libraries[name], *inputs, outs[name])

    return medians(interleave({name: partial(call, name) for name in libraries}, rounds))


# --- block-linear -------------------------------------------------------------------------------


class NativeSwitch:
    """Points the engine's native step and LM head at one library or another, and times them."""

    def __init__(self, model, libraries: dict[str, ctypes.CDLL]) -> None:
        self.step = model.native_decode
        self.head, self.head_entry = _step_head(model)
        if self.step is None or not hasattr(self.head, "_run"):
            raise SystemExit("needs quantization native (a native decode step and a block head)")
        self.libraries = libraries
        self.names = list(libraries)
        self.times = {name: {"step": [], "layers": [], "head": []} for name in libraries}
        self.current = self.names[0]

    def use(self, name: str) -> None:
        self.current = name
        library = self.libraries[name]
        self.step._run = self._timed(library.kvshare_decode_layers, "layers")
        self.head._run = self._timed(getattr(library, self.head_entry), "head")

    def _timed(self, fn, bucket: str):
        def timed(*args):
            started = time.perf_counter()
            status = fn(*args)
            self.times[self.current][bucket].append(time.perf_counter() - started)
            return status

        return timed

    def check_same_bits(self, engine, tolerate: bool) -> None:
        """One decode step's layers, then one head call, through each library on the same
        inputs."""
        layers, heads = {}, {}
        run = self.step.run

        def through_each(hidden, *args):
            start = hidden.clone()
            for name in self.names:
                hidden.copy_(start)
                self.use(name)
                layers[name] = run(hidden, *args).clone()
            return layers[name]

        self.step.run = through_each
        try:
            engine.step()
        finally:
            del self.step.run
        for name in self.names:
            self.use(name)
            heads[name] = self.head(layers[self.names[0]])
        check_same_bits(layers, "layers", tolerate)
        check_same_bits(heads, "head", tolerate)


def _step_head(model):
    """The head the engine's greedy steps here call, and its entry point: GreedyHead where the
    model has one, else the block head."""
    if model.greedy_head is not None:
        return model.greedy_head, "kvshare_greedy_head"
    return model.lm_head, "kvshare_block_linear_rows"


def native_step(args: argparse.Namespace) -> int:
    """The native CPU kernels of two builds: one engine, alternate decode steps.

    One engine (this tree's Python, config/cpu.yaml, drafting off, ~240-token prompts) decodes; its
    native layer stack (kvshare_decode_layers) and its LM head are called, step by step in turn,
    from this tree's library and from DIR's. It prints, per library, the median step, layer stack
    and head; and the weight bytes a step reads over its median step, against the read bandwidth
    measured in the same process before and after.

    Both builds must compute the same bits (as layout, tiling and scheduling changes do: the kernel
    tests hold them to it), since the KV cache is written by whichever ran the step; one decode step
    and one head call are checked first. --different-bits times builds whose sums run in another
    order (an attention split, say): it prints the largest difference and goes on, and the KV then
    holds whichever build's rounding wrote it."""
    import torch
    from profile_step import read_bandwidth_gbs, weight_bytes

    engine = cpu_engine(args.model)
    model = engine.runner.model
    entry_points = ("kvshare_decode_layers", _step_head(model)[1])
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"this tree": REPO, f"base ({args.base})": args.base}
        switch = NativeSwitch(model, build_each(trees, Path(scratch), args.isa, entry_points))
        weights = weight_bytes(model)
        step_mb = (weights["layers"] + weights["head"]) / 1e6
        bandwidth = [read_bandwidth_gbs(torch)]
        rng = random.Random(0)
        results = []
        for batch in args.batches:
            decode_in_turns(
                engine, switch, batch, args.steps, rng, args.prompt_tokens, args.different_bits
            )
            for name, times in switch.times.items():
                step_medians = {part: 1000 * v for part, v in medians(times).items()}
                results.append((batch, name, step_medians, len(times["step"])))
        bandwidth.append(read_bandwidth_gbs(torch))
    read = statistics.mean(bandwidth)
    print(f"read bandwidth {bandwidth[0]:.1f} GB/s before, {bandwidth[1]:.1f} after")
    print_header("batch", "kernels", "steps", "step ms", "layers ms", "head ms",
                 "weights GB/s (of read)")  # fmt: skip
    for batch, name, ms, count in results:
        gbs = step_mb / ms["step"]
        print_row(batch, name, count, f"{ms['step']:.2f}", f"{ms['layers']:.2f}",
                  f"{ms['head']:.2f}", f"{gbs:.1f} ({gbs / read:.0%})")  # fmt: skip
    return 0


# --- greedy-head --------------------------------------------------------------------------------


class GreedyToggle:
    """The model's greedy_head on ("greedy head") or off ("full head"); each step's _sample
    timed too."""

    def __init__(self, runner, head) -> None:
        self.model, self.head = runner.model, head
        self.names = ["greedy head", "full head"]
        self.current = self.names[0]
        self.times = {name: {"step": [], "sample": []} for name in self.names}
        sample = runner._sample

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return sample(*args, **kwargs)
            finally:
                self.times[self.current]["sample"].append(time.perf_counter() - started)

        runner._sample = timed

    def use(self, name: str) -> None:
        self.current = name
        self.model.greedy_head = self.head if name == "greedy head" else None

    def check_same_bits(self, engine, tolerate: bool) -> None:
        """Random hidden rows through both: the same tokens."""
        import torch

        hidden = torch.randn(8, self.model.spec.hidden_size)
        full = self.model.compute_logits(hidden).argmax(dim=-1)
        check_same_bits({"greedy head": self.head(hidden), "full head": full}, "tokens", tolerate)


def greedy_head(args: argparse.Namespace) -> int:
    """Greedy decoding with and without GreedyHead: one engine, alternate steps.

    Under quantization native a greedy row's token can come from GreedyHead (greedy_head.cpp:
    integer estimates of every logit, then the few panels that can hold the largest computed
    exactly) instead of the full Q8_0 LM head and an argmax. One engine (config/cpu.yaml, drafting
    and the audit off) decodes `batch` greedy sequences of ~`prompt-tokens`; step by step in turn
    its model's greedy_head is the GreedyHead or None (the full head). It prints per batch size and
    variant the median step and the median time of ModelRunner._sample (the head with the argmax or
    the greedy head, and the sampler's Python). It first checks that both give the same tokens on
    random hidden rows. Where the kernels' estimate lacks VNNI (kvshare_greedy_head_fast() is 0) the
    product leaves GreedyHead off; this then times the plain loops and says so."""
    from engine.runtime.cpu.block_linear import GreedyHead
    from engine.runtime.cpu.native import load_library
    from engine.runtime.loader import kvshare_cache_dir

    engine = cpu_engine()
    model = engine.runner.model
    head = model.greedy_head
    if head is None:
        head = GreedyHead(model.lm_head, load_library(kvshare_cache_dir(engine.config) / "kernels"))
        print("this build's estimate has no VNNI: timing the plain loops the product leaves off")
    toggle = GreedyToggle(engine.runner, head)
    rng = random.Random(0)
    print_header("batch", "variant", "steps", "step ms", "_sample ms")
    for batch in args.batches:
        decode_in_turns(engine, toggle, batch, args.steps, rng, args.prompt_tokens)
        for name, times in toggle.times.items():
            ms = {part: 1000 * v for part, v in medians(times).items()}
            print_row(batch, name, len(times["step"]), f"{ms['step']:.2f}", f"{ms['sample']:.2f}")
    return 0


# --- prefill-gemm -------------------------------------------------------------------------------
