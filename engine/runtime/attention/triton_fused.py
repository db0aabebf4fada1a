"""The Llama block's elementwise ops fused in Triton for the CUDA path: RMSNorm (alone or after
the residual add), SiLU- and GELU-tanh-and-multiply, and rope (alone or on q and k with the
KV store), one launch each where torch runs a chain of small kernels (eight for an RMSNorm,
seven for a rope).

TritonFusedOps has the interface of engine/runtime/cpu/fused.py's CpuFusedOps: each method
returns None (qk_norm False) for a call it does not cover and the model runs its torch code.
Every value is computed in fp32 and rounded to the storage dtype wherever the torch code
rounds, so bf16/fp16 results are torch's bits but where an fp32 intermediate (a sum's order,
exp, rsqrt) differs from torch's by an ulp. Kernels are built without FMA contraction
(enable_fp_fusion=False): torch rounds each product before the add that follows it.

bf16 travels as int16 bits and is converted by integer arithmetic, the same code compiled and
interpreted: the interpreter holds bf16 values as raw uint16 and its fp32 -> bf16 cast
truncates instead of rounding to nearest even. Nothing reads device memory on the host, so
every op can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

# Whether the kernels below were built for the interpreter (triton.jit reads the variable once,
# when it decorates): they then take CPU tensors, otherwise CUDA ones.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Storage kinds (a constexpr of every kernel, which tests the literals: jit code reads no
# plain globals); bf16 tensors are passed as int16 views.
_FP32, _BF16, _FP16 = 0, 1, 2
_KINDS = {torch.float32: _FP32, torch.bfloat16: _BF16, torch.float16: _FP16}
_MAX_ROW = 1 << 16  # the longest row one RMSNorm program holds in registers
_GATED_TILE = 1024  # elements of the intermediate axis per gated-activation program


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (in a uint32), rounded to nearest even as torch rounds; NaN -> 0x7FC0."""
    u = x.to(tl.uint32, bitcast=True)
    bits = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, bits)


@triton.jit
def _round(x, KIND: tl.constexpr):
    """fp32 x rounded to the storage kind's precision, still fp32 (torch's rounding of an op)."""
    if KIND == 1:
        x = (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _load(ptrs, mask, KIND: tl.constexpr):
    """Values of the storage kind as fp32 (masked lanes 0)."""
    if KIND == 1:
        bits = tl.load(ptrs, mask=mask, other=0)
        x = (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _store(ptrs, x, mask, KIND: tl.constexpr):
    """fp32 x rounded once to the storage kind."""
    if KIND == 1:
        tl.store(ptrs, _bf16_bits(x).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, out_ptr,
    stride_x0, stride_x1, stride_d0, inner_rows, size, size_fp32, eps,
    KIND: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row): out row = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), out contiguous.
    Row r of x is x[r // inner_rows, r % inner_rows] (2-D x: inner_rows 1). ADD: x += delta
    first, rounded and written back, and the sum is normed."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x_at = x_ptr + (row // inner_rows) * stride_x0 + (row % inner_rows) * stride_x1 + cols
    x = _load(x_at, mask, KIND)
    if ADD:
        x = _round(x + _load(delta_ptr + row * stride_d0 + cols, mask, KIND), KIND)
        _store(x_at, x, mask, KIND)
    # statistics in fp32 (masked lanes add 0); the mean as torch's CPU mean: sum / size
    inv_rms = tl.rsqrt(tl.div_rn(tl.sum(x * x, 0), size_fp32) + eps)
    normed = _round(x * inv_rms, KIND)
    weight = _load(weight_ptr + cols, mask, KIND)
    _store(out_ptr + row * size + cols, weight * normed, mask, KIND)


@triton.jit
def _gated_kernel(
    gate_up_ptr, out_ptr, stride_row, inter,
    KIND: tl.constexpr, GELU: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Program (row, tile): out = to_dtype(act(gate)) * up, gate and up the halves of a row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = cols < inter
    gate_at = gate_up_ptr + row * stride_row + cols
    gate = _load(gate_at, mask, KIND)
    up = _load(gate_at + inter, mask, KIND)
    if GELU:
        # g sigmoid(2y), not torch's g / 2 (1 + tanh(y)), which cancels below g = -3
        y2 = (gate + 0.044715 * (gate * gate * gate)) * 1.5957691216057308  # 2 sqrt(2 / pi)
        act = tl.div_rn(gate, 1.0 + tl.exp(-y2))
    else:
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate))  # F.silu's formula
    _store(out_ptr + row * inter + cols, _round(act, KIND) * up, mask, KIND)


@triton.jit
def _rope_heads(
    src, dst, src_head_stride, dst_head_stride, num_heads, half, cos, sin,
    KIND: tl.constexpr, DST_KIND: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Rotate-half rope of one token's heads (head h at src + h * src_head_stride) into dst;
    cos/sin [1, HALF_PAD] fp32. As apply_rope: each product and each sum rounded to KIND,
    then (a cache of another dtype) rounded once more to DST_KIND, as store_kv's .to()."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src_at = src + heads * src_head_stride + dims
    x1 = _load(src_at, mask, KIND)
    x2 = _load(src_at + half, mask, KIND)
    out1 = _round(_round(x1 * cos, KIND) - _round(x2 * sin, KIND), KIND)
    out2 = _round(_round(x2 * cos, KIND) + _round(x1 * sin, KIND), KIND)
    dst_at = dst + heads * dst_head_stride + dims
    _store(dst_at, out1, mask, DST_KIND)
    _store(dst_at + half, out2, mask, DST_KIND)


@triton.jit
def _load_rope(cos_ptr, sin_ptr, token, stride_rope, half, KIND: tl.constexpr,
               HALF_PAD: tl.constexpr):  # fmt: skip
    dims = tl.arange(0, HALF_PAD)
    mask = dims < half
    cos = _load(cos_ptr + token * stride_rope + dims, mask, KIND)
    sin = _load(sin_ptr + token * stride_rope + dims, mask, KIND)
    return cos[None, :], sin[None, :]


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_rope, num_heads, half,
    KIND: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Program (token): its heads rotated into out [T, heads, D] (contiguous)."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _load_rope(cos_ptr, sin_ptr, token, stride_rope, half, KIND, HALF_PAD)
    _rope_heads(
        x_ptr + token * stride_xt, out_ptr + token * num_heads * 2 * half, stride_xh, 2 * half,
        num_heads, half, cos, sin, KIND, KIND, HEADS_PAD, HALF_PAD,
    )  # fmt: skip


@triton.jit
def _rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_rope, stride_cache_block, stride_cache_slot, stride_cache_head,
    num_heads, num_kv_heads, half, num_slots,
    KIND: tl.constexpr, CACHE_KIND: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Program (token): q rotated into q [T, H, D]; k rotated and v copied into the token's
    slot of the caches, unless the slot is padding (< 0) or past the pool."""
    token = tl.program_id(0).to(tl.int64)
    head_dim = 2 * half
    row = qkv_ptr + token * stride_qkv  # [H q heads | Hkv k heads | Hkv v heads] x D
    cos, sin = _load_rope(cos_ptr, sin_ptr, token, stride_rope, half, KIND, HALF_PAD)
    _rope_heads(
        row, q_ptr + token * num_heads * head_dim, head_dim, head_dim, num_heads, half, cos, sin,
        KIND, KIND, H_PAD, HALF_PAD,
    )  # fmt: skip
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):  # a bad slot is dropped: writing it would corrupt
        at = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
        k_row = row + num_heads * head_dim
        _rope_heads(
            k_row, k_cache_ptr + at, head_dim, stride_cache_head, num_kv_heads, half, cos, sin,
            KIND, CACHE_KIND, HKV_PAD, HALF_PAD,
        )  # fmt: skip
        heads = tl.arange(0, HKV_PAD)[:, None]
        dims = tl.arange(0, HALF_PAD)[None, :]
        mask = (heads < num_kv_heads) & (dims < half)
        v_at = k_row + num_kv_heads * head_dim + heads * head_dim + dims
        v_dst = v_cache_ptr + at + heads * stride_cache_head + dims
        _store(v_dst, _load(v_at, mask, KIND), mask, CACHE_KIND)
        _store(v_dst + half, _load(v_at + half, mask, KIND), mask, CACHE_KIND)


class TritonFusedOps:
    """Fused ops in Triton kernels, for the model's `fused` slot (see CpuFusedOps).

    A kernel that fails to build or launch here (a first run on a new GPU or Triton) is
    logged and declined from then on, so the model runs its torch code: `failed` names them.
    """

    def __init__(self) -> None:
        self.failed: set[str] = set()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """x [T, E] or [T, heads, E] (rows may be strided, as q's heads in qkv) ->
        weight * to_dtype(x * rsqrt(mean(x^2) + eps)), contiguous, as RMSNorm.forward."""
        if x.dim() not in (2, 3) or not _covers(x, weight) or x.shape[-1] != weight.shape[0]:
            return None
        if weight.dim() != 1 or not weight.is_contiguous() or x.stride(-1) != 1:
            return None
        if x.shape[-1] > _MAX_ROW:
            return None
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        inner_rows, stride_inner = (1, 0) if x.dim() == 2 else (x.shape[1], x.stride(1))
        launched = self._norm(
            x, x, weight, out, x.stride(0), stride_inner, 0, inner_rows, eps, add=False
        )
        return out if launched else None

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor | None:
        """x [T, E] += delta (in place, the residual stream), then rms_norm(x): the normed
        rows, as `x = x + delta; RMSNorm.forward(x)` computes them."""
        if x.dim() != 2 or not x.is_contiguous() or not _covers(x, delta, weight):
            return None
        if delta.shape != x.shape or delta.stride(-1) != 1 or x.shape[1] != weight.shape[0]:
            return None
        if weight.dim() != 1 or not weight.is_contiguous() or x.shape[1] > _MAX_ROW:
            return None
        out = torch.empty_like(x)
        if x.numel() == 0:
            return out
        launched = self._norm(
            x, delta, weight, out, x.stride(0), 0, delta.stride(0), 1, eps, add=True
        )
        return out if launched else None

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [T, 2I] -> to_dtype(silu(gate)) * up [T, I], as LlamaMLP.forward."""
        return self._gated(gate_up, gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [T, 2I] -> to_dtype(gelu_tanh(gate)) * up [T, I], as Gemma3MLP.forward
        (computed as g sigmoid(2y), as CpuFusedOps does: see gemma3.py)."""
        return self._gated(gate_up, gelu=True)

    def qk_norm(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> bool:
        """Not covered: the model then norms q and k through rms_norm, on their strided heads,
        and rotates them through rope()."""
        return False

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x [T, heads, D] (rows may be a strided view), cos/sin [T, 1, D/2] -> rotated x,
        contiguous, as rope.apply_rope."""
        if x.dim() != 3 or x.stride(2) != 1 or not _covers(x, cos, sin):
            return None
        num_tokens, num_heads, head_dim = x.shape
        if not _rope_table_fits(cos, sin, x.dtype, num_tokens, head_dim):
            return None
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        launched = self._launch(
            "rope", _rope_kernel, (num_tokens,),
            _bits(x), _bits(cos), _bits(sin), _bits(out),
            x.stride(0), x.stride(1), cos.stride(0), num_heads, head_dim // 2,
            KIND=_KINDS[x.dtype], HEADS_PAD=triton.next_power_of_2(num_heads),
            HALF_PAD=triton.next_power_of_2(head_dim // 2), enable_fp_fusion=False,
        )  # fmt: skip
        return out if launched else None

    def rope_store(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], the fused projection's output
        num_heads: int,
        cos: torch.Tensor,  # [T, 1, D/2]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64 (or int32), < 0 for padding tokens
    ) -> torch.Tensor | None:
        """Rope on q and k, and K/V written to their slots as TorchRefBackend.store_kv does
        (padding slots skipped), in one launch: returns the rotated q [T, H, D]. Slots are not
        checked on the host (that would sync): one past the pool is skipped in the kernel."""
        if qkv.dim() != 2 or qkv.stride(1) != 1 or k_cache.dim() != 4:
            return None
        if not _covers(qkv, cos, sin, slot_mapping, k_cache, v_cache, dtypes=False):
            return None
        num_tokens = qkv.shape[0]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        if qkv.dtype not in _KINDS or k_cache.dtype not in _KINDS:
            return None
        if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            return None
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            return None
        if v_cache.stride() != k_cache.stride() or k_cache.stride(3) != 1:
            return None
        if not _rope_table_fits(cos, sin, qkv.dtype, num_tokens, head_dim):
            return None
        if slot_mapping.dtype not in (torch.int32, torch.int64):
            return None
        if slot_mapping.shape != (num_tokens,) or slot_mapping.stride(0) != 1:
            return None
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if num_tokens == 0:
            return q
        half = head_dim // 2
        launched = self._launch(
            "rope_store", _rope_store_kernel, (num_tokens,),
            _bits(qkv), _bits(cos), _bits(sin), slot_mapping, _bits(q),
            _bits(k_cache), _bits(v_cache),
            qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), num_heads, num_kv_heads, half, k_cache.shape[0] * block_size,
            KIND=_KINDS[qkv.dtype], CACHE_KIND=_KINDS[k_cache.dtype], BLOCK_SIZE=block_size,
            H_PAD=triton.next_power_of_2(num_heads),
            HKV_PAD=triton.next_power_of_2(num_kv_heads),
            HALF_PAD=triton.next_power_of_2(half), enable_fp_fusion=False,
        )  # fmt: skip
        return q if launched else None

    def gemv(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """Not covered: cuBLAS streams the LM head at bandwidth already."""
        return None

    def argmax(self, logits: torch.Tensor) -> None:
        """Not covered: torch's argmax is one kernel already."""
        return None

    def _norm(
        self, x, delta, weight, out, stride_x0, stride_x1, stride_d0, inner_rows, eps, add
    ) -> bool:
        size = x.shape[-1]
        block = triton.next_power_of_2(size)
        return self._launch(
            "rms_norm", _rms_norm_kernel, (out.numel() // size,),
            _bits(x), _bits(delta), _bits(weight), _bits(out),
            stride_x0, stride_x1, stride_d0, inner_rows, size, float(size), eps,
            KIND=_KINDS[x.dtype], ADD=add, BLOCK=block, num_warps=_row_warps(block),
            enable_fp_fusion=False,
        )  # fmt: skip

    def _gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        if gate_up.dim() != 2 or gate_up.stride(1) != 1 or not _covers(gate_up):
            return None
        if gate_up.shape[1] % 2:
            return None
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
        if out.numel() == 0:
            return out
        tile = min(triton.next_power_of_2(inter), _GATED_TILE)
        launched = self._launch(
            "gated", _gated_kernel, (num_tokens, triton.cdiv(inter, tile)),
            _bits(gate_up), _bits(out), gate_up.stride(0), inter,
            KIND=_KINDS[gate_up.dtype], GELU=gelu, TILE=tile, enable_fp_fusion=False,
        )  # fmt: skip
        return out if launched else None

    def _launch(self, name: str, kernel, grid: tuple[int, ...], *args, **options) -> bool:
        """kernel[grid](*args, **options); False, and the kernel declined from then on, where
        it fails (never while a CUDA graph captures: that is a bug to see)."""
        if name in self.failed:
            return False
        try:
            kernel[grid](*args, **options)
        except Exception as exc:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            logger.warning("fused Triton kernel %s failed, its torch code runs: %s", name, exc)
            self.failed.add(name)
            return False
        return True


def _covers(*tensors: torch.Tensor, dtypes: bool = True) -> bool:
    """All on the kernels' device (CUDA, or the CPU under the interpreter) and, with dtypes,
    of one dtype the kernels take."""
    device = "cpu" if INTERPRETED else "cuda"
    first = tensors[0]
    if any(t.device != first.device for t in tensors) or first.device.type != device:
        return False
    return not dtypes or (first.dtype in _KINDS and all(t.dtype == first.dtype for t in tensors))


def _rope_table_fits(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, num_tokens: int, head_dim: int
) -> bool:
    """cos and sin [T, 1, D/2] of the activations' dtype, rows of one stride (RoPE.lookup's)."""
    if head_dim % 2 or head_dim == 0:
        return False
    shape = (num_tokens, 1, head_dim // 2)
    return all(
        t.shape == shape and t.dtype == dtype and t.stride(2) == 1 and t.stride(0) == cos.stride(0)
        for t in (cos, sin)
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """What a kernel gets for t: bf16 as its int16 bits (see the module docstring)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _row_warps(block: int) -> int:
    """Warps for one row of `block` elements: about 8 to 16 elements a thread."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16
