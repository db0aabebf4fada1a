"""Prefill attention per layer: torch's SDPA over a gathered copy against the paged kernel.

    python benchmarks/prefill_attention.py [--rounds 5] [--threads 2]

SmolLM2's attention shape (9 query heads, 3 KV heads, head size 64, 16-token blocks in a shuffled
pool), one chunk of n queries ending at position seq_len: TorchRefBackend._prefill (the blocks
gathered into a dense copy, then SDPA, causal from position 0 and masked after) against
CpuNativeBackend._prefill (each query a decode query at its own position, K/V read in place).
Milliseconds per layer, median of interleaved rounds, and the largest difference between the two.

Then decode rows (--decode-context, 1 and 4 queries at the end of a context) through the paged
kernel alone, microseconds per layer: "hot", one layer's blocks called again and again (its K/V
stay in cache), and "cold", 30 layers' worth of distinct blocks called in turn (as in a real
step, each layer's K/V come from memory).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.config import EngineConfig
from engine.runtime.attention.cpu_native import create_backend
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.loader import kvshare_cache_dir

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CHUNKS = ((512, 512), (16, 1000), (64, 1000), (256, 1000))  # (queries, seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-context", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    native = create_backend(kvshare_cache_dir(EngineConfig()) / "kernels")
    reference = TorchRefBackend()
    num_blocks = 128
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (
        torch.randn(shape, generator=generator),
        torch.randn(shape, generator=generator),
    )
    table = torch.randperm(num_blocks, generator=generator)
    print(f"{args.threads} threads; ms per layer, median of {args.rounds} rounds\n")
    print("| queries | seq_len | SDPA on a gathered copy | paged kernel | max abs diff |")
    print("|---|---|---|---|---|")
    for num_queries, seq_len in CHUNKS:
        query = torch.randn(num_queries, HEADS, HEAD_DIM, generator=generator)
        calls = {
            backend: functools.partial(
                backend._prefill, query, k_cache, v_cache, table, seq_len, 0.125
            )
            for backend in (reference, native)
        }
        diff = (calls[reference]() - calls[native]()).abs().max().item()
        times: dict = {backend: [] for backend in calls}
        for _ in range(args.rounds):
            for backend, call in calls.items():
                started = time.perf_counter()
                for _ in range(5):
                    call()
                times[backend].append((time.perf_counter() - started) / 5 * 1e3)
        sdpa, paged = (statistics.median(times[b]) for b in (reference, native))
        print(f"| {num_queries} | {seq_len} | {sdpa:.2f} | {paged:.2f} | {diff:.1e} |")
    decode_rows(native, args.decode_context, args.rounds, generator)


def decode_rows(native, seq_len: int, rounds: int, generator: torch.Generator) -> None:
    """Per-layer time of 1 and 4 queries at the end of seq_len, hot and cold (see above)."""
    num_blocks = 4096
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    blocks_per_layer = -(-seq_len // BLOCK_SIZE)
    layers = torch.randperm(num_blocks, generator=generator)[: 30 * blocks_per_layer]
    tables = list(layers.view(30, blocks_per_layer))
    print("\n| decode queries | seq_len | hot us per layer | cold us per layer (30 layers) |")
    print("|---|---|---|---|")
    for num_queries in (1, 4):
        query = torch.randn(num_queries, HEADS, HEAD_DIM, generator=generator)
        times: dict = {"hot": [], "cold": []}
        for _ in range(rounds):
            for name, layer_tables in (("hot", tables[:1] * 30), ("cold", tables)):
                started = time.perf_counter()
                for table in layer_tables:
                    native._prefill(query, k_cache, v_cache, table, seq_len, 0.125)
                times[name].append((time.perf_counter() - started) / 30 * 1e6)
        hot, cold = (statistics.median(times[name]) for name in ("hot", "cold"))
        print(f"| {num_queries} | {seq_len} | {hot:.1f} | {cold:.1f} |")


if __name__ == "__main__":
    main()
