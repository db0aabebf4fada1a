"""Paged attention over a KV pool on 4 KiB pages and on 2 MiB (transparent huge) pages.

    python benchmarks/kv_pages.py [--positions 270 1000] [--rounds 40]

SmolLM2's shapes (30 layers, 9 query heads over 3 KV heads of 64, fp16 KV, 16-token blocks),
one decode row per layer through the native paged kernel (kvshare_paged_decode, 2 threads), as
a lone stream's step runs it; each layer's pool a ~1 GiB model pool's share. Two block
placements: consecutive (a fresh pool) and scattered (a pool the prefix cache has churned: each
of the row's blocks anywhere). Two page sizes: the pool as torch.zeros allocates it, and as the
CPU runner does (engine/runtime/cpu/allocator.py zeros_on_huge_pages). Interleaved rounds, each
once after a 96 MB sweep (the step's weights have just passed through the caches) and once
warm; medians, in ms for the 30 layers.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
POOL_BLOCKS = 2730  # ~1 GiB of fp16 K and V over 30 layers
FLOAT32, FLOAT16 = 0, 2  # the kernels' dtype codes (engine/runtime/cpu/native.py)


def run_layers(library, pool, query, tables, seq_lens, out) -> float:
    """The 30 layers' paged attention of one batch (query, out [B, HEADS, HEAD_DIM]) through
    `library`'s kvshare_paged_decode on 2 threads, no window; layer i reads K and V from
    pool[2i], pool[2i + 1] through tables[i] ([B, max_blocks] int32, or [max_blocks] for one
    sequence). Seconds."""
    batch, max_blocks = query.shape[0], tables[0].shape[-1]
    started = time.perf_counter()
    for layer in range(LAYERS):
        status = library.kvshare_paged_decode(
            FLOAT32, FLOAT16, query.data_ptr(), pool[2 * layer].data_ptr(),
            pool[2 * layer + 1].data_ptr(), tables[layer].data_ptr(), seq_lens.data_ptr(),
            out.data_ptr(), batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, max_blocks,
            ctypes.c_float(HEAD_DIM**-0.5), 2, 0,
        )  # fmt: skip
        assert status == 0, status
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[270, 1000])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)

    import torch

    from engine.core.config import EngineConfig
    from engine.runtime.cpu import native
    from engine.runtime.cpu.allocator import zeros_on_huge_pages

    library = native.load_library(EngineConfig().cache_root() / "kernels")
    shape = (POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    pools = {
        "4 KiB pages": torch.zeros(2 * LAYERS, *shape, dtype=torch.float16),
        "huge pages": zeros_on_huge_pages((2 * LAYERS, *shape), torch.float16),
    }
    for pool in pools.values():
        pool.normal_()
    query, out = torch.randn(1, HEADS, HEAD_DIM), torch.empty(1, HEADS, HEAD_DIM)
    sweep = torch.ones(24 * 1024 * 1024)
    rng = random.Random(0)

    print("| positions | blocks | pages | after a sweep ms | warm ms |")
    print("|---|---|---|---|---|")
    for positions in args.positions:
        num_blocks = -(-positions // BLOCK)
        seq_lens = torch.tensor([positions], dtype=torch.int32)
        first = rng.randrange(POOL_BLOCKS - num_blocks)
        placements = {
            "consecutive": [torch.arange(first, first + num_blocks, dtype=torch.int32)] * LAYERS,
            "scattered": [
                torch.tensor(rng.sample(range(POOL_BLOCKS), num_blocks), dtype=torch.int32)
                for _ in range(LAYERS)
            ],
        }
        times: dict[tuple[str, str, bool], list[float]] = {}
        for _ in range(args.rounds):
            for placement, tables in placements.items():
                for pages, pool in pools.items():
                    for cold in (True, False):
                        sweep.sum() if cold else run_layers(
                            library, pool, query, tables, seq_lens, out
                        )
                        seconds = run_layers(library, pool, query, tables, seq_lens, out)
                        times.setdefault((placement, pages, cold), []).append(seconds)
        for placement in placements:
            for pages in pools:
                cold, warm = (
                    1000 * statistics.median(times[(placement, pages, c)]) for c in (True, False)
                )
                print(f"| {positions} | {placement} | {pages} | {cold:.3f} | {warm:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
