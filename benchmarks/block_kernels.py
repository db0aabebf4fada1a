"""The GGUF block kernels against the libraries that could do the same product, per shape.

    python benchmarks/block_kernels.py [--rows 1 8] [--rounds 5] [--threads 2] [--clock cpu]
    python benchmarks/block_kernels.py --rows 16 64 256 512 --rounds 3   # prefill chunk sizes
    python benchmarks/block_kernels.py --model gemma-3-270m   # Q5_0, Q4_K, Q6_K

SmolLM2's own tensors (the embedded GGUF: Q4_1 projections, the Q8_0 embedding as the LM
head), or with --model gemma-3-270m three of Gemma 3's layer-0 projections, each computed with
fp32 activations by:
  block        engine/runtime/cpu/block_tiles.cpp on the blocks in GGUF's row order
  panels       the same blocks reordered into panels of 16 output columns (what quantization
               native serves for every format; K-quants as per-group panels)
  int4pack     torch's _weight_int4pack_mm_for_cpu (groupwise int4 with a scale and zero per
               32 weights: Q4_1 maps onto it exactly as w = (q - 8) * d + (m + 8 d)); Q4_1 only
  fbgemm_fp16  fbgemm's fp16-weight linear (quantization fp16)
  onednn_fp32  oneDNN on packed fp32 weights (quantization none)
  dequant_fp32 the blocks dequantized at each call, then F.linear (oneDNN): the prefill option
               that keeps no fp32 copy resident
Rounds interleave the candidates; each figure is the median over rounds of the mean call time,
with the error of each candidate against F.linear on the dequantized weights (fp64). Also the
bytes each reads and the machine's read bandwidth (a large tensor's sum), so a row shows the
fraction of bandwidth it reaches. --clock cpu times by process CPU time (a loaded machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.config import EngineConfig
from engine.runtime.cpu.block_linear import BlockEmbedding, BlockLinear, BlockWeight, to_panels
from engine.runtime.cpu.linear import PackedLinear
from engine.runtime.cpu.native import load_library
from engine.runtime.cpu.quant import Fp16Linear, can_quantize
from engine.runtime.loader import kvshare_cache_dir, resolve_model_source

TENSORS = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight")
HEAD = "token_embd.weight"
# With --model gemma-3-270m: layer 0's Q5_0 gate/up, Q4_K attention output and Q6_K down (its
# 262,144-row head would need GBs of fp32 copies for the library candidates).
GEMMA_TENSORS = ("blk.0.ffn_gate.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight")


def block_weights(config: EngineConfig, names: tuple[str, ...]) -> dict[str, BlockWeight]:
    """Tensors `names` of the model's GGUF, as stored (GGUF's block order), by name."""
    from gguf import GGUFReader

    reader = GGUFReader(str(resolve_model_source(config).gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    weights = {}
    for name in names:
        data = torch.from_numpy(np.array(tensors[name].data, dtype=np.uint8))
        weights[name] = BlockWeight(
            tensors[name].tensor_type.name, data, int(tensors[name].shape[0])
        )
    return weights


def int4pack_candidate(weight: BlockWeight):
    """torch's int4 weight-only matmul on Q4_1's codes, or None where this torch lacks it."""
    if weight.format != "Q4_1" or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    blocks = weight.data.view(weight.out_features, -1, 20)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # [N, K/32]
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    nibbles = blocks[:, :, 4:]
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(weight.out_features, -1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 2)
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)


def candidates(weight: BlockWeight, library) -> dict:
    dense = weight.dequantize()
    found = {"block": BlockLinear(weight, None, library)}
    panels = to_panels(weight)
    if panels is not weight:
        found["panels"] = BlockLinear(panels, None, library)
    int4 = int4pack_candidate(weight)
    if int4 is not None:
        found["int4pack"] = int4
    if can_quantize():
        found["fbgemm_fp16"] = Fp16Linear(dense, None)
    found["onednn_fp32"] = PackedLinear(dense, None)
    found["dequant_fp32"] = dequantizing_candidate(weight, library)
    return found


def dequantizing_candidate(weight: BlockWeight, library):
    """What a prefill chunk would pay to run oneDNN without keeping an fp32 copy: the blocks
    dequantized at call time (the library's row kernel), then F.linear."""
    table = BlockEmbedding(weight, library)
    ids = torch.arange(weight.out_features)
    return lambda x: F.linear(x, table(ids))


def read_bandwidth_gbs(clock) -> float:
    big = torch.ones(64 * 1024 * 1024)  # 256 MB
    best = float("inf")
    for _ in range(5):
        started = clock()
        big.sum()
        best = min(best, clock() - started)
    return big.numel() * 4 / best / 1e9


def time_call(fn, x, reps: int, clock) -> float:
    fn(x)
    started = clock()
    for _ in range(reps):
        fn(x)
    return (clock() - started) / reps


def measure(name: str, weight: BlockWeight, library, rows: int, args, clock) -> list[dict]:
    found = candidates(weight, library)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(0))
    reference = F.linear(x.double(), weight.dequantize().double())
    reps = 5 if weight.out_features > 10000 else 100
    times: dict[str, list[float]] = {key: [] for key in found}
    errors = {}
    with torch.inference_mode():
        for key, fn in found.items():
            errors[key] = (fn(x).double() - reference).abs().max().item()
        for _ in range(args.rounds):
            for key, fn in found.items():
                times[key].append(time_call(fn, x, reps, clock))
    return [
        {"tensor": name, "format": weight.format, "rows": rows, "candidate": key,
         "us": 1e6 * statistics.median(samples), "max_abs_err": errors[key]}
        for key, samples in times.items()
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--model", default=None, help="as kvshare serve --model (default SmolLM2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    config = EngineConfig() if args.model is None else EngineConfig(model=args.model)
    library = load_library(kvshare_cache_dir(config) / "kernels")
    names = (*TENSORS, HEAD) if args.model is None else GEMMA_TENSORS
    weights = block_weights(config, names)
    bandwidth = read_bandwidth_gbs(clock)
    print(f"read bandwidth {bandwidth:.1f} GB/s; {args.threads} threads; clock {args.clock}\n")
    print("| tensor | format | rows | candidate | us | GB/s read (block bytes) | max abs err |")
    print("|---|---|---|---|---|---|---|")
    for name, weight in weights.items():
        for rows in args.rows:
            for row in measure(name, weight, library, rows, args, clock):
                gbs = weight.data.numel() / row["us"] / 1e3
                print(f"| {name} | {row['format']} | {rows} | {row['candidate']} | "
                      f"{row['us']:.1f} | {gbs:.1f} | {row['max_abs_err']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
