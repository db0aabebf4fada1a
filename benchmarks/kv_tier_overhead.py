"""What the second KV tier costs the single-pool case (issue 53: "off by default only if it costs
the single-pool case anything measurable"): a stream of unique prompts that never hit, through a
pool small enough that every request evicts cached blocks, so every eviction is spilled to the
tier and nothing is ever loaded back. Tier off against kv_tier disk, fresh engines, interleaved
rounds, medians; the served configuration (config/cpu.yaml) otherwise.

    python benchmarks/kv_tier_overhead.py [--rounds 5] [--requests 24] [--prompt-tokens 600]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kv_tier_engine import build_engine, random_prompt, serve
from benchmarks.run_summary import cpu_line


def one_round(kv_tier: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [random_prompt(rng, args.prompt_tokens) for _ in range(args.requests)]
    with tempfile.TemporaryDirectory(prefix="kvshare-tier-") as tier_dir:
        engine = build_engine(kv_tier, args.num_kv_blocks, tier_dir, audit_sample_rate=0.0)
        serve(engine, prompts[0], args.max_tokens)  # warm-up: kernels, first allocations
        started = time.perf_counter()
        served = [serve(engine, prompt, args.max_tokens) for prompt in prompts[1:]]
        wall_s = time.perf_counter() - started
        stats = engine.stats()
        engine.close()
    return {
        "tier": kv_tier,
        "wall_s": wall_s,
        "ttft_p50_s": statistics.median(s.ttft_s for s in served),
        "num_evictions": stats.num_evictions,
        "num_tier_stored_blocks": stats.num_tier_stored_blocks,
        "num_hit_tokens": stats.prefix_cache_hits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/kv_tier_overhead.json")
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        order = ("off", "disk") if index % 2 == 0 else ("disk", "off")
        rounds += [one_round(kv_tier, args, seed=index) for kv_tier in order]
    medians = {
        tier: {
            key: statistics.median(r[key] for r in rounds if r["tier"] == tier)
            for key in ("wall_s", "ttft_p50_s", "num_evictions", "num_tier_stored_blocks")
        }
        for tier in ("off", "disk")
    }
    ratio = medians["disk"]["wall_s"] / medians["off"]["wall_s"]
    per_round = [
        r_disk["wall_s"] / r_off["wall_s"]
        for r_off, r_disk in zip(
            [r for r in rounds if r["tier"] == "off"],
            [r for r in rounds if r["tier"] == "disk"],
            strict=True,
        )
    ]
    print(cpu_line())
    print(
        f"{args.requests - 1} unique {args.prompt_tokens}-token prompts, pool {args.num_kv_blocks}"
    )
    print("| tier | wall s (median) | TTFT p50 ms | evictions | blocks spilled |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for tier in ("off", "disk"):
        m = medians[tier]
        print(
            f"| {tier} | {m['wall_s']:.2f} | {1000 * m['ttft_p50_s']:.0f} | "
            f"{m['num_evictions']:.0f} | {m['num_tier_stored_blocks']:.0f} |"
        )
    print(f"disk / off wall: {ratio:.3f} (per round: {', '.join(f'{x:.3f}' for x in per_round)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    summary = {"cpu": cpu_line(), "args": vars(args), "rounds": rounds, "medians": medians}
    Path(args.out).write_text(json.dumps(summary | {"ratio": ratio, "per_round": per_round}))


if __name__ == "__main__":
    main()
