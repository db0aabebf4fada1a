"""In-process A/B of greedy decoding with and without GreedyHead: one engine, alternate steps.

    python benchmarks/ab_greedy_head.py [--batches 8 4 1] [--steps 300] [--prompt-tokens 300]

Under quantization native a greedy row's token can come from GreedyHead (greedy_head.cpp,
greedy_head: integer estimates of every logit, then the few panels that can hold the largest
computed exactly) instead of the full Q8_0 LM head and an argmax. One engine (config/cpu.yaml,
drafting and the audit off) decodes `batch` greedy sequences of ~`prompt-tokens`; step by step
in turn its model's greedy_head is the GreedyHead or None (the full head), so both see the same
host. It prints per batch size and variant the median step and the median time of
ModelRunner._sample (the head with the argmax or the greedy head, and the sampler's Python).
It first checks that both give the same tokens on random hidden rows (the tests hold them to
it on the model's own hidden states).
Where the kernels' estimate lacks VNNI (kvshare_greedy_head_fast() is 0) the product leaves
GreedyHead off; the script then times the plain loops and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))


class Toggle:
    """ab_native_step.run_batch's alternation: the model's greedy_head on ("greedy head") or off
    ("full head"); each step's _sample timed too."""

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
        assert torch.equal(self.head(hidden), self.model.compute_logits(hidden).argmax(dim=-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 4, 1])
    parser.add_argument("--steps", type=int, default=300, help="decode steps per batch size")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    args = parser.parse_args(argv)

    from ab_native_step import run_batch

    from app.settings import load_settings
    from engine.llm_engine import LLMEngine
    from engine.runtime.cpu.block_linear import GreedyHead
    from engine.runtime.cpu.native import load_library
    from engine.runtime.loader import kvshare_cache_dir

    config = load_settings(REPO / "config" / "cpu.yaml", environ={}).to_engine_config()
    config = dataclasses.replace(config, audit_sample_rate=0.0, speculative_ngram_tokens=0)
    engine = LLMEngine(config)
    model = engine.runner.model
    head = model.greedy_head
    if head is None:
        library = load_library(kvshare_cache_dir(config) / "kernels")
        head = GreedyHead(model.lm_head, library)
        print("this build's estimate has no VNNI: timing the plain loops the product leaves off")
    toggle = Toggle(engine.runner, head)
    rng = random.Random(0)
    print("| batch | variant | steps | step ms | _sample ms |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        run_batch(engine, toggle, batch, args.steps, rng, args.prompt_tokens)
        for name, times in toggle.times.items():
            step = 1000 * statistics.median(times["step"])
            sample = 1000 * statistics.median(times["sample"])
            print(f"| {batch} | {name} | {len(times['step'])} | {step:.2f} | {sample:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
