"""The Llama block's elementwise ops fused on the CPU: RMSNorm, SiLU-and-multiply, rope.

In torch each is a chain of small ops (an RMSNorm is eight, a rope seven), which at 32
decoding sequences cost more in dispatch and passes over memory than in arithmetic. The
native library of engine/runtime/cpu/kernels.cpp does each in one pass, rounding to the storage
dtype wherever the torch code rounds. Every method returns None for a call it does
not cover (dtype, device, layout, sizes not multiples of 16); the caller then runs its torch
code, so results never depend on the library being there.
"""

from __future__ import annotations

import ctypes

import torch

from engine.runtime.cpu.native import DTYPE_CODES

_LANES = 16  # the kernels' vector width in floats: row lengths must be multiples of it


class CpuFusedOps:
    """Fused ops over the native library (loaded by engine/runtime/cpu/native.py)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """x [T, E] -> weight * to_dtype(x * rsqrt(mean(x^2) + eps)), as RMSNorm.forward."""
        if not (_covers(x, 2) and _covers(weight, 1) and x.shape[1] == weight.shape[0]):
            return None
        out = torch.empty_like(x)
        self._library.kvshare_rms_norm(
            DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.shape[0], x.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [T, 2I] -> silu(gate) * up [T, I], as LlamaMLP.forward."""
        if not _covers(gate_up, 2) or gate_up.shape[1] % (2 * _LANES):
            return None
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((num_tokens, inter), dtype=gate_up.dtype)
        self._library.kvshare_silu_mul(
            DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
            num_tokens, inter, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x [T, heads, D] (rows may be a strided view), cos/sin [T, 1, D/2] -> rotated x,
        contiguous, as llama.apply_rope."""
        num_tokens, num_heads, head_dim = x.shape
        half = head_dim // 2
        if x.dtype not in DTYPE_CODES or x.device.type != "cpu" or half % _LANES:
            return None
        if x.stride(2) != 1 or x.stride(1) != head_dim:  # heads side by side in each row
            return None
        if not all(_covers(t, 3) and t.shape == (num_tokens, 1, half) for t in (cos, sin)):
            return None
        if cos.dtype != x.dtype or sin.dtype != x.dtype:
            return None
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype)
        self._library.kvshare_rope(
            DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
            out.data_ptr(), num_tokens, num_heads, head_dim, torch.get_num_threads(),
        )  # fmt: skip
        return out


def _covers(t: torch.Tensor, ndim: int) -> bool:
    """A contiguous CPU tensor of a supported dtype whose rows are whole vectors."""
    return (
        t.dim() == ndim
        and t.dtype in DTYPE_CODES
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.shape[-1] % _LANES == 0
    )
