"""The Llama block's elementwise ops fused on the CPU: RMSNorm (alone or after the residual
add, or per head on q and k), SiLU-and-multiply (GELU-tanh-and-multiply for Gemma), rope
(alone or on q and k with the KV store), the LM head's matrix-vector product for a few rows,
and greedy sampling's argmax.

In torch each is a chain of small ops (an RMSNorm is eight, a rope seven), which at 32
decoding sequences cost more in dispatch and passes over memory than in arithmetic. The
native library of engine/runtime/cpu/fused_ops.cpp does each in one pass, rounding to the storage
dtype wherever the torch code rounds. Every method returns None for a call it does
not cover (dtype, device, layout, sizes not multiples of 16); the caller then runs its torch
code, so results never depend on the library being there.
"""

from __future__ import annotations

import ctypes

import torch

from engine.runtime.cpu.native import DTYPE_CODES, cache_dtype_code

_LANES = 16  # the kernels' vector width in floats: row lengths must be multiples of it
# The most rows gemv() takes: one row reads 113 MB of SmolLM2's LM head in 3.7-4.4 ms here
# (1 thread, CPU time) against 6.4-6.7 ms through packed oneDNN, two rows 4.0 vs 8.3 ms; from
# 3 rows on oneDNN is faster.
GEMV_MAX_ROWS = 2


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
        return self._gated(self._library.kvshare_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [T, 2I] -> gelu_tanh(gate) * up [T, I], as Gemma3MLP.forward."""
        return self._gated(self._library.kvshare_gelu_tanh_mul, gate_up)

    def _gated(self, kernel, gate_up: torch.Tensor) -> torch.Tensor | None:
        if not _covers(gate_up, 2) or gate_up.shape[1] % (2 * _LANES):
            return None
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((num_tokens, inter), dtype=gate_up.dtype)
        kernel(
            DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(),
            num_tokens, inter, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def qk_norm(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], the fused projection's output
        num_heads: int,
        num_kv_heads: int,
        q_weight: torch.Tensor,  # [D]
        k_weight: torch.Tensor,
        eps: float,
    ) -> bool:
        """Each query head of qkv normed by q_weight and each key head by k_weight, in place,
        as RMSNorm.forward on q and k computes them; False (nothing touched) where the kernel
        does not cover the call."""
        head_dim = q_weight.shape[0]
        if not (_covers(qkv, 2) and _covers(q_weight, 1) and _covers(k_weight, 1)):
            return False
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            return False
        if k_weight.shape != q_weight.shape or not qkv.dtype == q_weight.dtype == k_weight.dtype:
            return False
        self._library.kvshare_qk_norm(
            DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), q_weight.data_ptr(),
            k_weight.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return True

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x [T, heads, D] (rows may be a strided view), cos/sin [T, 1, D/2] -> rotated x,
        contiguous, as rope.apply_rope."""
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

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """x [T, E] += delta (in place, the residual stream), then rms_norm(x): the normed
        rows, as `x = x + delta; RMSNorm.forward(x)` computes them."""
        if not (_covers(x, 2) and _covers(delta, 2) and _covers(weight, 1)):
            return None
        if delta.shape != x.shape or delta.dtype != x.dtype or x.shape[1] != weight.shape[0]:
            return None
        out = torch.empty_like(x)
        self._library.kvshare_add_rms_norm(
            DTYPE_CODES[x.dtype], x.data_ptr(), delta.data_ptr(), weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], the fused projection's output
        num_heads: int,
        cos: torch.Tensor,  # [T, 1, D/2]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> torch.Tensor | None:
        """Rope on q and k, and K/V written to their slots as TorchRefBackend.store_kv does,
        in one pass over qkv: returns the rotated q [T, H, D]."""
        num_tokens = qkv.shape[0]
        _, _, num_kv_heads, head_dim = k_cache.shape
        half = head_dim // 2
        if not (_covers(qkv, 2) and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim):
            return None
        if half % _LANES or not all(_covers(t, 4) for t in (k_cache, v_cache)):
            return None
        cache_code = cache_dtype_code(qkv.dtype, k_cache.dtype)
        if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or cache_code is None:
            return None
        if not all(_covers(t, 3) and t.shape == (num_tokens, 1, half) for t in (cos, sin)):
            return None
        if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
            return None
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            return None
        if slot_mapping.shape != (num_tokens,):
            return None
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype)
        status = self._library.kvshare_rope_store(
            DTYPE_CODES[qkv.dtype], cache_code, qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            num_tokens, num_heads, num_kv_heads, head_dim,
            k_cache.shape[0] * k_cache.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:  # nothing was written
            raise IndexError("slot_mapping holds a slot outside the KV cache")
        return q

    def gemv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x [N, K] @ weight [V, K]^T for N <= GEMV_MAX_ROWS, weight read once (F.linear)."""
        if not (_covers(x, 2) and _covers(weight, 2)) or x.dtype != weight.dtype:
            return None
        if x.shape[0] > GEMV_MAX_ROWS or x.shape[1] != weight.shape[1]:
            return None
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
        self._library.kvshare_gemv(
            DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(), out.data_ptr(),
            x.shape[0], x.shape[1], weight.shape[0], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits float32 [N, V] -> int64 [N], as logits.argmax(dim=-1) (ties: the first;
        a NaN beats any number) in one vectorized pass per row."""
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
            return None
        if not logits.is_contiguous():
            return None
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        status = self._library.kvshare_argmax(
            logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr()
        )
        return out if status == 0 else None  # 2: a row length the kernel does not take


def _covers(t: torch.Tensor, ndim: int) -> bool:
    """A contiguous CPU tensor of a supported dtype whose rows are whole vectors."""
    return (
        t.dim() == ndim
        and t.dtype in DTYPE_CODES
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.shape[-1] % _LANES == 0
    )
