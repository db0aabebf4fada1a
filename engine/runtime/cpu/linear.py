"""Linear layers on oneDNN with their weights packed once, for the CPU.

F.linear hands every call the weight in its plain layout (fp32 goes to MKL, bf16 to oneDNN).
Reordering each weight once at start-up into oneDNN's blocked layout
(mkldnn._reorder_linear_weight) and calling oneDNN's linear on it directly is faster for
both. Measured on this project's machine (AMD EPYC, 2 threads, SmolLM2's five
projection shapes summed, timed one after another in one process):
fp32 11.0 -> 5.7 ms at 1 row, 27.0 -> 12.0 ms at 32 rows, 78.9 -> 69.8 ms at 2048 rows;
bf16 4.8 -> 2.4, 10.1 -> 6.3 and 38.1 -> 34.0 ms.

oneDNN builds (and keeps) native state per input row count: a server that saw every prefill
length from 1 to 1024 grew ~0.8 MB per request, without end, and so did 4 SmolLM2 linears
called at 200 distinct row counts (+300 MB, still +300 MB with its primitive cache off, flat
when the same counts came again). So PackedLinear pads the rows up to one of a bounded set of
sizes (padded_rows): exact up to 32 (decode batches), then 8 sizes per doubling, at most 1/8
of padding rows; those 72 sizes up to 1024 rows kept the same four linears flat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.cpu import capabilities

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_EXACT_ROWS = 32  # row counts up to this run unpadded: decode batches, few-row LM heads
_SIZES_PER_DOUBLING_LOG2 = 3  # 8 padded sizes per doubling: at most 1/8 of the rows padding


def padded_rows(rows: int) -> int:
    """The row count oneDNN sees for `rows` rows: one of a bounded set of sizes (32 exact, then
    8 per doubling: 88 up to 4096 rows), the smallest not below `rows`."""
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 1 - _SIZES_PER_DOUBLING_LOG2)
    return -(-rows // step) * step


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x W^T + b with W held packed in oneDNN's layout; x is [N, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Not a parameter: inference only. No batch-size hint: one layout serves every M.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        padding = padded_rows(rows) - rows
        if padding == 0:
            return _onednn_linear(x, self.packed, self.bias)
        # Zero rows below x: a bounded set of shapes reaches oneDNN (see the module docstring).
        out = _onednn_linear(F.pad(x, (0, 0, 0, padding)), self.packed, self.bias)
        return out[:rows]  # the leading rows of a contiguous output: still contiguous

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can run PackedLinear for `device` and `dtype`.

    bf16 asks the CPU probe (engine/runtime/cpu/capabilities.py): oneDNN's bf16 linear needs
    AVX-512 (or AVX-NE-CONVERT) and refuses to run elsewhere; KVSHARE_CPU_BF16_LINEAR=0 turns
    it off. Where this is False the model keeps plain nn.Linear (F.linear).
    """
    if device.type != "cpu" or dtype not in _PACKABLE_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or capabilities.cpu_capabilities().bf16_linear


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear (in place); returns the count."""
    return replace_linears(module, PackedLinear)


def replace_linears(module: nn.Module, linear_class: type[nn.Module]) -> int:
    """Replace every nn.Linear under `module` by linear_class(weight, bias) (in place): packed
    or quantized copies. Returns the count."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, linear_class(child.weight, child.bias))
            count += 1
        else:
            count += replace_linears(child, linear_class)
    return count
