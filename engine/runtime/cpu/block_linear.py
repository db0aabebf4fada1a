"""Weights kept in GGUF block formats and computed as stored (engine/runtime/cpu/block_linear.cpp).

A GGUF file stores each weight row as blocks: Q4_0, Q4_1, Q5_0 and Q8_0 hold 32 weights a block
(an fp16 scale, a minimum for Q4_1, and 4-, 5- or 8-bit codes), Q4_K and Q6_K 256 a super-block.
The dequantized tensor is what the exact mode (quantization none) computes on; BlockLinear
computes the same product from the blocks (each group expanded in registers, fp32 activations
and sums), so it is F.linear on those weights up to summation order, at a sixth to a third of
fp32's bytes. A row's output does not depend on the other rows of the batch.

Module names stay those of the layers they replace: BlockLinear for a projection or the LM head,
BlockEmbedding for a table whose looked-up rows are dequantized (SmolLM2 ties its Q8_0 embedding
to the LM head: both read the same bytes).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.runtime.cpu.k_panels import PANEL_GROUP_BYTES, dequantize_k_panels, to_k_panels

# GGML's type numbers of the formats the block kernels compute on, with (weights, bytes) per block
# (kvshare_native.h's format codes).
BLOCK_FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
}
FORMAT_NAMES = {code: name for name, (code, _, _) in BLOCK_FORMATS.items()}
# Formats the block kernels also compute as panels, with the byte widths of the fields at the
# head of each block (the fp16 scale, then Q4_1's fp16 minimum or Q5_0's 32 fifth bits), which a
# panel keeps whole per row; the code bytes after them are transposed. A panel format's kernel
# code is PANEL_CODE + GGML's number.
PANEL_FORMATS = {"Q4_0": (2,), "Q4_1": (2, 2), "Q5_0": (2, 4), "Q8_0": (2,)}
PANEL_CODE = 100
PANEL_COLUMNS = 16  # output columns per panel: the kernels' vector lanes
# The K-quants also compute as panels, stored per group with their scales applied
# (engine/runtime/cpu/k_panels.py): not GGUF's bytes moved, and larger by the ratio of
# PANEL_GROUP_BYTES to their 32-weight share of a super-block.
K_PANEL_FORMATS = tuple(PANEL_GROUP_BYTES)


@dataclass(frozen=True)
class BlockWeight:
    """A [out_features, in_features] weight as GGUF blocks: data [out_features, row bytes] uint8."""

    format: str  # a key of BLOCK_FORMATS
    data: torch.Tensor
    in_features: int
    # "rows": GGUF's order, each row's blocks in turn; "panels": reordered by to_panels (16
    # rows' blocks of each 32-weight group side by side), still [out, row bytes].
    layout: str = "rows"

    def __post_init__(self) -> None:
        _, weights, size = BLOCK_FORMATS[self.format]
        if self.in_features % weights or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"{self.format} blocks cannot hold rows of {self.in_features}")
        if self.layout == "panels" and self.format in PANEL_GROUP_BYTES:
            weights, size = 32, PANEL_GROUP_BYTES[self.format]
        if self.data.shape[1] != self.in_features // weights * size:
            raise ValueError(f"{self.format} rows of {self.in_features} are not {self.data.shape}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def code(self) -> int:
        """The kernels' format code: GGML's type number, plus PANEL_CODE for panels."""
        code = BLOCK_FORMATS[self.format][0]
        return code + PANEL_CODE if self.layout == "panels" else code

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] as GGUF dequantizes it (gguf-py: the reference)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if self.layout == "panels" and self.format in PANEL_GROUP_BYTES:
            return dequantize_k_panels(self.format, self.data, self.in_features)
        qtype = GGMLQuantizationType(BLOCK_FORMATS[self.format][0])
        rows = to_rows(self).data.numpy()
        return torch.from_numpy(dequantize(rows, qtype).astype(np.float32))


def to_panels(weight: BlockWeight) -> BlockWeight:
    """weight's blocks reordered as the panel kernels read them, when its format has them and
    its rows come in whole panels; otherwise weight itself. Per 32-weight group of each panel
    of 16 rows: each head field of the 16 rows side by side (the fp16 scales, then Q4_1's
    minimums or Q5_0's fifth bits), then the code bytes transposed ([code byte][row]). A
    permutation of the same bytes: nothing is rounded. Q4_K and Q6_K: each group with its scales
    applied (k_panels.py), the same weights."""
    if weight.layout != "rows" or weight.out_features % PANEL_COLUMNS:
        return weight
    if weight.format in PANEL_GROUP_BYTES:
        data = to_k_panels(weight.format, weight.data, weight.in_features)
        return BlockWeight(weight.format, data, weight.in_features, "panels")
    fields = PANEL_FORMATS.get(weight.format)
    if fields is None:
        return weight
    _, per_block, size = BLOCK_FORMATS[weight.format]
    groups = weight.in_features // per_block
    # [panels, 16 rows, groups, block bytes] -> [panels, groups, 16 rows, block bytes]
    blocks = weight.data.view(-1, PANEL_COLUMNS, groups, size).transpose(1, 2)
    parts, start = [], 0
    for width in fields:  # [panels, groups, 16 rows x width]
        parts.append(blocks[..., start : start + width].flatten(-2))
        start += width
    parts.append(blocks[..., start:].transpose(-2, -1).flatten(-2))  # [.., code byte x 16 rows]
    data = torch.cat(parts, dim=-1).reshape(weight.out_features, groups * size).contiguous()
    return BlockWeight(weight.format, data, weight.in_features, "panels")


def to_rows(weight: BlockWeight) -> BlockWeight:
    """The GGUF row order of a weight in either layout (to_panels undone; not for K-quant
    panels, whose super-block scales are no longer apart)."""
    if weight.layout == "rows":
        return weight
    if weight.format not in PANEL_FORMATS:
        raise ValueError(f"{weight.format} panels do not go back to GGUF's rows")
    _, per_block, size = BLOCK_FORMATS[weight.format]
    groups = weight.in_features // per_block
    panels = weight.data.view(-1, groups, PANEL_COLUMNS * size)
    parts, start = [], 0
    for width in PANEL_FORMATS[weight.format]:  # [panels, groups, 16 rows, width]
        end = start + PANEL_COLUMNS * width
        parts.append(panels[..., start:end].unflatten(-1, (PANEL_COLUMNS, width)))
        start = end
    parts.append(panels[..., start:].unflatten(-1, (-1, PANEL_COLUMNS)).transpose(-2, -1))
    blocks = torch.cat(parts, dim=-1)  # [panels, groups, 16 rows, block bytes]
    data = blocks.transpose(1, 2).reshape(weight.out_features, groups * size).contiguous()
    return BlockWeight(weight.format, data, weight.in_features)


class BlockLinear(nn.Module):
    """y = x W^T (+ b) with W held as GGUF blocks; x and y are fp32 [N, *]."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None, library: ctypes.CDLL):
        super().__init__()
        self.block_weight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None if bias is None else bias.detach().float()
        self._run = library.kvshare_block_linear_rows

    def forward(self, x: torch.Tensor, tile_rows: torch.Tensor | None = None) -> torch.Tensor:
        # x: [N, in_features] -> [N, out_features]; tile_rows: [N] int32, each row's path
        # (1 a prompt row's: AMX tiles where this process has them, else the prefill GEMM; 0 the
        # FMAs; AttentionMetadata.tile_rows), or None: the library's default path
        x = x.contiguous().float()
        rows = x.shape[0]
        if tile_rows is not None and (tile_rows.shape != (rows,) or tile_rows.dtype != torch.int32):
            raise ValueError(
                f"tile_rows must be int32 [{rows}], not {tile_rows.dtype} {tile_rows.shape}"
            )
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        status = self._run(
            self.block_weight.code, x.data_ptr(), self.block_weight.data.data_ptr(),
            out.data_ptr(), rows, self.in_features, self.out_features, torch.get_num_threads(),
            None if tile_rows is None else tile_rows.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"kvshare_block_linear_rows failed with status {status}")
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.block_weight.format}"
        )


class BlockLinearParts(nn.Module):
    """A fused projection whose row parts are stored in different formats (Gemma 3's q and k
    in Q5_0 beside v in Q8_0): one BlockLinear per run of rows of one format, their outputs
    side by side. Each output column is computed as its part's own call computes it."""

    def __init__(self, parts: list[BlockLinear]) -> None:
        super().__init__()
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("the parts of a fused projection must share their input")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.bias = None  # none of its own: each part holds its rows' bias (if any)

    def forward(self, x: torch.Tensor, tile_rows: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat([part(x, tile_rows) for part in self.parts], dim=-1)


class GreedyHead:
    """Each row's greedy token under a Q8_0 panel LM head, without computing all of its logits.

    greedy_head.cpp estimates every logit from int8 codes of the row (VNNI:
    4 products per lane and instruction), bounds the estimate's error by the head row's norm
    times the row's quantization error (plus a margin for rounding), and computes exactly, with
    the head's own tile, only the panels whose logits can reach the largest lower bound: the
    answer is torch.argmax of the full head's logits, ties to the first index, in about half the
    time at 4-8 rows. The product uses it where greedy_head.cpp runs the estimate on AVX-512
    VNNI and VBMI (quant.greedy_head: an AVX-512 build on a CPU that has them); elsewhere the
    estimate runs in plain loops, for the tests.
    """

    # The head's rows dequantized at a time to find their norms (9 MB at SmolLM2's width).
    NORM_CHUNK_ROWS = 4096

    def __init__(self, head: BlockLinear, library: ctypes.CDLL) -> None:
        weight = head.block_weight
        if weight.code != PANEL_CODE + BLOCK_FORMATS["Q8_0"][0] or head.bias is not None:
            raise ValueError("GreedyHead takes a Q8_0 head in panels, without a bias")
        self.head = head
        self._run = library.kvshare_greedy_head
        self.norms = self._row_norms(head, library)
        if not torch.isfinite(self.norms).all():
            raise ValueError("GreedyHead takes a head whose rows are finite")
        # (row, panel) pairs the last call computed exactly: how far the estimate narrowed it.
        self._computed = torch.zeros(1, dtype=torch.int64)

    @property
    def panels_computed(self) -> int:
        """How many (row, panel) pairs the last call computed exactly (of rows x V / 16)."""
        return int(self._computed)

    @classmethod
    def _row_norms(cls, head: BlockLinear, library: ctypes.CDLL) -> torch.Tensor:
        """[V] fp32: each head row's L2 norm, computed in fp64 and rounded up, never below it."""
        weight = head.block_weight
        table = BlockEmbedding(weight, library)
        norms = torch.empty(weight.out_features, dtype=torch.float64)
        for start in range(0, weight.out_features, cls.NORM_CHUNK_ROWS):
            ids = torch.arange(start, min(start + cls.NORM_CHUNK_ROWS, weight.out_features))
            norms[ids] = table(ids).double().square().sum(dim=1).sqrt()
        return (norms * (1 + 1e-6)).float()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, E] -> [N] int64 token ids; None if a row is not finite (the caller then
        computes the logits)."""
        x = hidden.contiguous().float()
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        weight = self.head.block_weight
        status = self._run(
            weight.code, x.data_ptr(), weight.data.data_ptr(), self.norms.data_ptr(),
            ids.data_ptr(), x.shape[0], weight.in_features, weight.out_features,
            torch.get_num_threads(), self._computed.data_ptr(),
        )  # fmt: skip
        if status == 3:
            return None
        if status != 0:
            raise RuntimeError(f"kvshare_greedy_head failed with status {status}")
        return ids


class BlockEmbedding(nn.Module):
    """An embedding table held as GGUF blocks: each looked-up row dequantized on the fly."""

    def __init__(self, weight: BlockWeight, library: ctypes.CDLL) -> None:
        super().__init__()
        self.block_weight = weight
        self.embedding_dim = weight.in_features
        self._run = library.kvshare_block_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, E] fp32, the rows GGUF's dequantization gives
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.block_weight.out_features):
            raise IndexError("token id outside the embedding table")
        out = torch.empty((ids.numel(), self.embedding_dim), dtype=torch.float32)
        status = self._run(
            self.block_weight.code, self.block_weight.data.data_ptr(), ids.data_ptr(),
            out.data_ptr(), ids.numel(), self.embedding_dim,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"kvshare_block_rows failed with status {status}")
        return out

    def extra_repr(self) -> str:
        weight = self.block_weight
        return f"{weight.out_features}, {self.embedding_dim}, {weight.format}"


def quantize_q8_0(weight: torch.Tensor) -> BlockWeight:
    """Q8_0 blocks of an fp32 [out, in] weight (in a multiple of 32), as llama.cpp quantizes:
    per 32 weights an fp16 scale max|w| / 127 and int8 codes round(w / scale)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(weight.detach().float().numpy(), GGMLQuantizationType.Q8_0)
    return BlockWeight("Q8_0", torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape[1])


def format_runs(weights: list[BlockWeight]) -> list[BlockWeight] | None:
    """The rows of `weights` in order as runs of one format each (adjacent weights of a format
    concatenated); None when their row lengths differ."""
    if any(w.in_features != weights[0].in_features for w in weights):
        return None
    runs: list[list[BlockWeight]] = []
    for weight in weights:
        if runs and runs[-1][0].format == weight.format:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    return [concat_rows(run) for run in runs]


def concat_rows(weights: list[BlockWeight]) -> BlockWeight | None:
    """One BlockWeight of the rows of `weights` in order (a fused qkv or gate_up projection);
    None when their formats or row lengths differ."""
    first = weights[0]
    assert all(w.layout == "rows" for w in weights), "concatenate before to_panels"
    if any(w.format != first.format or w.in_features != first.in_features for w in weights):
        return None
    return BlockWeight(first.format, torch.cat([w.data for w in weights]), first.in_features)
