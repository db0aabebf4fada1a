"""In-process A/B of a step's Python overhead: the tenth round's changes undone every other step.

    python benchmarks/ab_step_overhead.py [--batches 1 8] [--steps 400]

The tenth round (benchmarks/README.md) took two costs out of every CPU step: the sampler copied
the [N, V] logits before its processing stages even when none applied (plain greedy or
temperature rows), and the engine's per-step stats snapshot built EngineStats three times
(engine_stats, then dataclasses.replace twice). This script runs one engine (config/cpu.yaml,
drafting off, ~240-token prompts, greedy) and, step by step in turn, puts both old forms back
("copy + 3 snapshots") or leaves the tree's ("this tree"), so both see the same host at the same
moment, as benchmarks/ab_native_step.py does for kernel builds. It prints the median step of
each; the tokens cannot differ (the old forms compute the same values).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from pathlib import Path

from ab_native_step import REPO, run_batch


class OldOverhead:
    """Switches the sampler's copy and the triple stats construction on and off."""

    def __init__(self, engine) -> None:
        from engine.runtime.sampler import Sampler

        engine_type = type(engine)
        new_process, new_snapshot = Sampler._process, engine_type._snapshot

        def old_process(sampler, raw, draws):  # the copy made whether or not a stage writes
            return new_process(sampler, raw.clone(), draws)

        def old_snapshot(engine, step):  # two more constructions of the same EngineStats
            return dataclasses.replace(dataclasses.replace(new_snapshot(engine, step)))

        self.names = ["this tree", "copy + 3 snapshots"]
        self._forms = {self.names[0]: (new_process, new_snapshot)}
        self._forms[self.names[1]] = (old_process, old_snapshot)
        self._types = (Sampler, engine_type)
        self.times = {name: {"step": []} for name in self.names}
        self.current = self.names[0]

    def use(self, name: str) -> None:
        self.current = name
        sampler_type, engine_type = self._types
        sampler_type._process, engine_type._snapshot = self._forms[name]

    def check_same_bits(self, engine, tolerate: bool = False) -> None:
        """Nothing to check: both forms compute the same values."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=400, help="decode steps per batch size")
    args = parser.parse_args(argv)

    from app.settings import load_settings
    from engine.llm_engine import LLMEngine

    config = load_settings(REPO / "config" / "cpu.yaml", environ={}).to_engine_config()
    config = dataclasses.replace(config, audit_sample_rate=0.0, speculative_ngram_tokens=0)
    engine = LLMEngine(config)
    variants = OldOverhead(engine)
    rng = random.Random(0)
    print("| batch | step overhead | steps | step ms |")
    print("|---|---|---|---|")
    for batch in args.batches:
        run_batch(engine, variants, batch, args.steps, rng)
        variants.use(variants.names[0])
        for name, times in variants.times.items():
            median = 1000 * statistics.median(times["step"])
            print(f"| {batch} | {name} | {len(times['step'])} | {median:.3f} |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
