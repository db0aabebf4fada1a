"""In-process A/B of the native CPU kernels: two builds, one engine, alternate steps.

    python benchmarks/ab_native_step.py --base DIR [--batches 1 8] [--steps 600] \
        [--prompt-tokens 240] [--different-bits]

On a shared host two runs of the same code differ by more than most kernel changes do (the
batch-1 step has moved between 8.4 and 12.6 ms from one run to the next, benchmarks/README.md).
This script takes that drift out. One engine (this tree's Python, config/cpu.yaml, drafting
off, ~240-token prompts) decodes; its native layer stack (kvshare_decode_layers) and its LM
head (kvshare_block_linear_rows) are called, step by step in turn, from the kernel library
built from this tree's engine/runtime/cpu and from the one built from DIR's (a worktree of
another commit, 206c5b4 or later: the entry points changed there), with the same compiler and
flags (engine/runtime/cpu/native.py). It prints, per library, the
median step, layer stack and head; and the weight bytes a step reads over its median step,
against the read bandwidth measured in the same process before and after.

Both builds must compute the same bits (as layout, tiling and scheduling changes do: the kernel
tests hold them to it), since the KV cache is written by whichever ran the step. The script
checks it first: one decode step and one head call run with both libraries on the same inputs,
and their outputs must be equal bit for bit. --different-bits times builds whose sums run in
another order (an attention split, say): it prints the largest difference and goes on, and
the KV then holds whichever build's rounding wrote it.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from profile_step import _is_decode_only

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

PROMPT_TOKENS = 240


def build(tree: Path, target: Path, isa: str) -> ctypes.CDLL:
    """The kernel library of `tree`'s engine/runtime/cpu sources, as native.py builds its own."""
    from engine.runtime.cpu import native

    compiler = native._find_compiler()
    if compiler is None:
        raise SystemExit("needs a C++ compiler (g++)")
    sources = tuple(tree / "engine/runtime/cpu" / source.name for source in native.SOURCES)
    native._compile(compiler, isa, target, sources)
    library = ctypes.CDLL(str(target))
    if not hasattr(library, "kvshare_block_linear_rows"):  # the entry points changed there
        raise SystemExit(f"{tree}: its kernels predate 206c5b4 (each row's path); take a newer one")
    native._declare(library)
    return library


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class Alternation:
    """Points the engine's native step and LM head at one library or the other, and times them."""

    def __init__(self, model, libraries: dict[str, ctypes.CDLL]) -> None:
        # Greedy rows take their tokens from GreedyHead where the model has one, the rest the
        # block head: the one the engine's steps here call.
        self.step = model.native_decode
        self.head = model.greedy_head if model.greedy_head is not None else model.lm_head
        self.head_entry = (
            "kvshare_greedy_head" if model.greedy_head is not None else "kvshare_block_linear_rows"
        )
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

    def check_same_bits(self, engine, tolerate: bool = False) -> None:
        """One decode step's layers and head through each library on the same inputs; with
        `tolerate`, a difference is printed (its largest element) instead of ending the run."""
        import torch

        step, outputs = self.step, {}
        run = step.run

        def both_layers(hidden, *args):
            start = hidden.clone()
            for name in self.libraries:
                hidden.copy_(start)
                self.use(name)
                outputs[("layers", name)] = run(hidden, *args).clone()
            return outputs[("layers", name)]

        step.run = both_layers
        try:
            engine.step()
        finally:
            del step.run
        hidden = outputs[("layers", self.names[0])]
        for name in self.libraries:
            self.use(name)
            outputs[("head", name)] = self.head(hidden)
        for part in ("layers", "head"):
            first, *others = [outputs[(part, name)] for name in self.libraries]
            if all(torch.equal(first, other) for other in others):
                continue
            if tolerate:
                largest = max((first - other).abs().max().item() for other in others)
                print(f"the two builds' {part} differ by up to {largest:.3g}")
            else:
                raise SystemExit(f"the two builds' {part} differ: this A/B needs the same bits")


def run_batch(
    engine,
    alternation,
    batch: int,
    steps: int,
    rng,
    prompt_tokens: int = PROMPT_TOKENS,
    tolerate: bool = False,
) -> None:
    """`batch` fresh prompts of `prompt_tokens` decoded `steps` steps, alternation.use() switching
    between its names step by step (alternation: an Alternation, or anything with its names,
    use(), current, times[name]["step"] and check_same_bits(engine, tolerate))."""
    from engine.core.protocol import EngineRequest
    from engine.core.sampling_params import SamplingParams

    ids = [f"ab-{batch}-{i}-{rng.randrange(10**9)}" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for request_id in ids:
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        engine.add_request(EngineRequest(request_id, prompt, params))
    while not _is_decode_only(engine, batch):  # every prompt prefilled: one token a sequence
        engine.step()
    alternation.check_same_bits(engine, tolerate)
    for times in alternation.times.values():
        for samples in times.values():
            samples.clear()
    names = alternation.names
    for k in range(steps):
        alternation.use(names[k % len(names)])
        alternation.times[alternation.current]["step"].append(_seconds(engine.step))
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other tree (a worktree)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=600, help="decode steps per batch size")
    parser.add_argument("--isa", default="native", help="the kernels' build level")
    parser.add_argument(
        "--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each prompt's length"
    )
    parser.add_argument(
        "--different-bits",
        action="store_true",
        help="time builds whose outputs differ (a changed summation order): print the difference",
    )
    args = parser.parse_args(argv)

    import torch
    from profile_step import read_bandwidth_gbs, weight_bytes

    from app.settings import load_settings
    from engine.llm_engine import LLMEngine

    config = load_settings(REPO / "config" / "cpu.yaml", environ={}).to_engine_config()
    config = dataclasses.replace(config, audit_sample_rate=0.0, speculative_ngram_tokens=0)
    engine = LLMEngine(config)
    with tempfile.TemporaryDirectory() as scratch:
        libraries = {
            "this tree": build(REPO, Path(scratch) / "this.so", args.isa),
            f"base ({args.base})": build(args.base.resolve(), Path(scratch) / "base.so", args.isa),
        }
        alternation = Alternation(engine.runner.model, libraries)
        weights = weight_bytes(engine.runner.model)
        step_mb = (weights["layers"] + weights["head"]) / 1e6
        bandwidth = [read_bandwidth_gbs(torch)]
        rng = random.Random(0)
        results = []
        for batch in args.batches:
            run_batch(
                engine, alternation, batch, args.steps, rng, args.prompt_tokens, args.different_bits
            )
            for name, times in alternation.times.items():
                medians = {part: 1000 * statistics.median(v) for part, v in times.items()}
                results.append((batch, name, medians, len(times["step"])))
        bandwidth.append(read_bandwidth_gbs(torch))
    read = statistics.mean(bandwidth)
    print(f"read bandwidth {bandwidth[0]:.1f} GB/s before, {bandwidth[1]:.1f} after")
    print("| batch | kernels | steps | step ms | layers ms | head ms | weights GB/s (of read) |")
    print("|---|---|---|---|---|---|---|")
    for batch, name, medians, count in results:
        gbs = step_mb / medians["step"]
        print(
            f"| {batch} | {name} | {count} | {medians['step']:.2f} | {medians['layers']:.2f} "
            f"| {medians['head']:.2f} | {gbs:.1f} ({gbs / read:.0%}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
