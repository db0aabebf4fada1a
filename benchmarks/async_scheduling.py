"""Async scheduling (engine/sched/lookahead.py) on against off, on one warm engine.

The served configuration (config/cpu.yaml on the CPU, speculative decoding off; pass
--device cuda on a GPU) runs the same batch of equal random prompts, greedy, a fixed number of
tokens each, with `async_scheduling` off and on in interleaved rounds; printed: the median
output tok/s of each, their ratio, the steps scheduled ahead, and whether the tokens were the
same. On the CPU the ratio is about 1 (the same cores schedule and compute: `auto` keeps it
off); on a GPU the host's scheduling hides behind the step in flight. Never part of
`make test`.

Usage: python benchmarks/async_scheduling.py [--batch 8 --prompt-len 128 --output-len 64
       --rounds 5 --device cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kv_tier_engine import served_config
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def one_round(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple:
    """(output tok/s, lookahead steps, tokens) of the batch run to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = engine.stats().num_lookahead_steps
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    tokens = [r.token_ids[0] for r in results]
    rate = sum(len(t) for t in tokens) / seconds
    return rate, engine.stats().num_lookahead_steps - before, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    # speculative decoding off: cpu.yaml drafts at batch 1, where no lookahead runs
    overrides: dict = {
        "device": args.device, "enable_prefix_cache": False, "speculative_ngram_tokens": 0,
    }  # fmt: skip
    if args.device != "cpu":  # the CPU settings' block formats are the CPU's alone
        overrides.update(quantization="none", kv_cache_dtype="auto", dtype="auto",
                         attention_backend="auto")  # fmt: skip
    engine = LLMEngine(served_config(**overrides))
    rng = random.Random(0)
    vocab = engine.model_info.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    one_round(engine, prompts[:1], 4)  # warm-up
    rates: dict[bool, list[float]] = {False: [], True: []}
    texts: dict[bool, list] = {}
    lookaheads = 0
    for _ in range(args.rounds):
        for setting in (False, True):
            engine.async_scheduling = setting
            rate, num_lookaheads, tokens = one_round(engine, prompts, args.output_len)
            rates[setting].append(rate)
            texts.setdefault(setting, tokens)
            lookaheads = num_lookaheads if setting else lookaheads
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    steps = args.output_len  # decode steps of the batch: the prompt's step samples one
    print(f"device {engine.runner.device}, batch {args.batch}, prompts {args.prompt_len}, "
          f"{args.output_len} tokens each, {args.rounds} interleaved rounds (medians)")  # fmt: skip
    print(f"async_scheduling off: {off:8.1f} tok/s")
    print(f"async_scheduling on:  {on:8.1f} tok/s  ({on / off:.3f}x)")
    same = texts[True] == texts[False]
    print(f"steps scheduled ahead: {lookaheads} of {steps}; same tokens: {same}")


if __name__ == "__main__":
    main()
