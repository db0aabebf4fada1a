"""Time a stats snapshot and an evicting allocation for pools of 1k and 100k blocks.

Both should cost the same at any pool size: block-state counts, the leak count and the
evictable count are kept up to date as blocks change, and eviction pops a kept LRU heap.
The test tests/engine/kv/test_running_figures.py checks it in operation counts; this script
shows it in time (medians of interleaved rounds).

    python benchmarks/stats_cost.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, make_namespace
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler

SIZES = (1_000, 100_000)
NAMESPACE = make_namespace("w")
REPEATS = 200  # calls per timing


def full_of_cached_blocks(num_blocks: int) -> tuple[KVCacheManager, Scheduler]:
    pool = BlockPool(num_blocks, 4)
    kv = KVCacheManager(pool, enable_prefix_cache=True)
    assert kv.prefix_cache is not None
    for index in range(num_blocks):
        block_id = pool.allocate()
        kv.prefix_cache.insert(NAMESPACE, [index, 1, 2, 3], [block_id])
        pool.decref(block_id)
    return kv, Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)


def time_stats(scheduler: Scheduler) -> float:
    started = time.perf_counter()
    for _ in range(REPEATS):
        scheduler.stats()
    return (time.perf_counter() - started) / REPEATS


def time_allocation(kv: KVCacheManager) -> float:
    """Allocate (evicting one cached block each time) and free, REPEATS times."""
    seqs = [
        Sequence(i, f"r{i}", 0, [-1, -2, -3], SamplingParams(max_tokens=1), seed=0)
        for i in range(REPEATS)
    ]
    started = time.perf_counter()
    for seq in seqs:
        assert kv.allocate_slots(seq, 3)
    elapsed = time.perf_counter() - started
    for seq in seqs:
        kv.free(seq)
    return elapsed / REPEATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    built = {size: full_of_cached_blocks(size) for size in SIZES}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):  # interleaved: both sizes see the same machine noise
        for size, (kv, scheduler) in built.items():
            times.setdefault(("stats", size), []).append(time_stats(scheduler))
            times.setdefault(("allocation", size), []).append(time_allocation(kv))
    print("| operation | 1k blocks (us) | 100k blocks (us) | ratio |")
    print("|---|---|---|---|")
    for what in ("stats", "allocation"):
        small, large = (statistics.median(times[(what, size)]) * 1e6 for size in SIZES)
        print(f"| {what} | {small:.1f} | {large:.1f} | {large / small:.2f} |")


if __name__ == "__main__":
    main()
