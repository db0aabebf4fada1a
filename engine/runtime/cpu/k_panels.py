"""Q4_K and Q6_K weights as panels (block_kernels.h: PanelQ4_K, PanelQ6_K).

A K-quant super-block holds eight 32-weight groups under one fp16 scale, with each group's own
scale (and Q4_K's minimum) packed in 6 bits (Q4_K) or held as int8 per 16 weights (Q6_K). The
panel kernels want a group's scale for 16 output columns as one vector, so each group is stored
on its own here with the super-block's scale already applied: D = d * scale and M = -(dmin *
min) as fp32. Those are exactly the floats GGUF's dequantization computes (an fp16 times an
integer of at most 8 bits needs at most 19 significant bits), so each weight, D q + M, is GGUF's
value, and dequantize() gives back gguf-py's tensor bit for bit.

Per panel of 16 output rows and per 32-weight group, in this order:
- Q4_K (24 bytes a row and group, 18 in GGUF): D[16], M[16] as fp32, then 16 code rows of 16
  bytes: row j holds, per column, weight j in its low nibble and weight j + 16 in its high one
  (Q4_0's panel codes).
- Q6_K (40 bytes, 26.25 in GGUF): Da[16], Db[16] as fp32 (weights 0-15 and 16-31 of the group
  have their own scales), then 32 code rows of 16 int8: row k holds weight k's q - 32.
"""

from __future__ import annotations

import numpy as np
import torch

COLUMNS = 16  # a panel's output rows (PANEL_COLUMNS)
# Bytes per output row and 32-weight group, as panels.
PANEL_GROUP_BYTES = {"Q4_K": 24, "Q6_K": 40}
_SUPER = 256  # weights per super-block
_FIELDS = 2 * 4 * COLUMNS  # the two fp32 fields of a group, 16 columns each
_CHUNK_ROWS = 64 * COLUMNS  # rows converted at a time (whole panels)


def _half(raw: np.ndarray) -> np.ndarray:
    """fp16 values stored as byte pairs (the last axis) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks [rows, supers, 144] -> D, M [rows, supers * 8] and codes [rows, supers * 8, 32]."""
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.int32)
    scale = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    low = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    D = d[..., None] * scale.astype(np.float32)
    M = -(dmin[..., None] * low.astype(np.float32))
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)  # 32 bytes per pair of groups
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [rows, supers, 4, 2, 32]: groups 2c, 2c + 1
    rows = blocks.shape[0]
    return D.reshape(rows, -1), M.reshape(rows, -1), codes.reshape(rows, -1, 32)


def _q6_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks [rows, supers, 210] -> Da, Db [rows, supers * 8] and codes q - 32 [.., 32] int8."""
    rows, supers = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 64).astype(np.int16)
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 32).astype(np.int16)
    scales = blocks[..., 192:208].view(np.int8).astype(np.float32)  # one per 16 weights
    d = _half(blocks[..., 208:210])
    # Per half of 128 weights, weights 32 i + l (l < 32) for i = 0..3.
    quarters = [
        (ql[..., 0:32] & 15) | ((qh & 3) << 4),
        (ql[..., 32:64] & 15) | (((qh >> 2) & 3) << 4),
        (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4),
    ]
    codes = (np.stack(quarters, axis=3) - 32).astype(np.int8)  # [rows, supers, 2, 4, 32]
    D = (d[..., None] * scales).reshape(rows, -1, 2)  # [rows, groups, (first, second half)]
    return D[..., 0], D[..., 1], codes.reshape(rows, -1, 32)


def _columns(values: np.ndarray, panels: int) -> np.ndarray:
    """[rows, groups, ...] -> [panels, groups, 16 columns, ...]."""
    return values.reshape(panels, COLUMNS, *values.shape[1:]).swapaxes(1, 2)


def to_k_panels(format: str, data: torch.Tensor, in_features: int) -> torch.Tensor:
    """GGUF rows data [out, row bytes] of a Q4_K or Q6_K weight -> its panel bytes
    [out, in_features / 32 * PANEL_GROUP_BYTES[format]] (out a multiple of 16), converted
    _CHUNK_ROWS rows at a time: the temporaries stay a few MB whatever the tensor (a large
    vocabulary's Q6_K head took about ten times its own size converted at once)."""
    rows = data.shape[0]
    out = np.empty((rows, in_features // 32 * PANEL_GROUP_BYTES[format]), dtype=np.uint8)
    source = data.numpy()
    for start in range(0, rows, _CHUNK_ROWS):
        end = min(start + _CHUNK_ROWS, rows)
        out[start:end] = _panel_bytes(format, source[start:end], in_features)
    return torch.from_numpy(out)


def _panel_bytes(format: str, data: np.ndarray, in_features: int) -> np.ndarray:
    """to_k_panels of whole panels' rows, at once."""
    rows = data.shape[0]
    panels, groups = rows // COLUMNS, in_features // 32
    blocks = data.reshape(rows, in_features // _SUPER, -1)
    if format == "Q4_K":
        first, second, codes = _q4_k_groups(blocks)
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)  # [rows, g, 16]
    else:
        first, second, codes = _q6_k_groups(blocks)
        packed = codes.view(np.uint8)  # [rows, g, 32]
    parts = [
        _columns(first.astype(np.float32), panels).copy().view(np.uint8),
        _columns(second.astype(np.float32), panels).copy().view(np.uint8),
        # [panels, groups, code row, column]
        _columns(packed, panels).swapaxes(2, 3).reshape(panels, groups, -1),
    ]
    parts[0] = parts[0].reshape(panels, groups, -1)
    parts[1] = parts[1].reshape(panels, groups, -1)
    return np.concatenate(parts, axis=-1).reshape(rows, groups * PANEL_GROUP_BYTES[format])


def dequantize_k_panels(format: str, data: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 weight [out, in_features] that panel bytes hold (GGUF's values)."""
    rows = data.shape[0]
    panels, groups = rows // COLUMNS, in_features // 32
    raw = data.numpy().reshape(panels, groups, COLUMNS * PANEL_GROUP_BYTES[format])
    first = np.ascontiguousarray(raw[..., : _FIELDS // 2]).view(np.float32)  # [p, g, 16]
    second = np.ascontiguousarray(raw[..., _FIELDS // 2 : _FIELDS]).view(np.float32)
    codes = raw[..., _FIELDS:].reshape(panels, groups, -1, COLUMNS).swapaxes(2, 3)
    if format == "Q4_K":  # [p, g, column, 16 bytes] -> 32 codes: low nibbles, then high
        q = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.float32)
        weights = first[..., None] * q + second[..., None]
    else:
        q = codes.view(np.int8).astype(np.float32)  # [p, g, column, 32]
        weights = np.concatenate(
            [first[..., None] * q[..., :16], second[..., None] * q[..., 16:]], axis=-1
        )
    # [p, g, column, 32] -> [p, column, g, 32] -> [out, in]
    return torch.from_numpy(np.ascontiguousarray(weights.swapaxes(1, 2)).reshape(rows, -1))
