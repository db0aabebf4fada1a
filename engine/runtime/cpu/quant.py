"""Fewer weight bytes per token on the CPU: the `quantization` modes besides none (exact).

native and q8_0 compute on GGUF blocks (engine/runtime/cpu/block_linear.py): native on the
blocks a GGUF model is stored in (the served model itself, not an approximation of it), q8_0 on
Q8_0 blocks made from any float model at load. fp16 and int8 run on fbgemm (torch.ops.quantized,
prepacked once), the fastest of the options measured on SmolLM2's shapes (benchmarks/README.md,
"Quantization"); fbgemm needs AVX2 at least:

- fp16: weights stored as float16 (half of fp32's bytes), activations and accumulation in
  fp32 (fbgemm's linear_dynamic_fp16). Top-1 agreement with the exact model 1.0 on the
  quality text; a row's output does not depend on the other rows of the batch.
- int8: per-output-channel int8 weights (a quarter of the bytes), activations quantized per
  token to 7 bits (fbgemm's dynamic int8 linear). About 3x faster matmuls than fp32, but it
  misses the quality goals on SmolLM2 (top-1 agreement ~0.78): opt-in only.

int8 details. fbgemm quantizes its input per tensor, from the batch's own min and max, so a
row's result would depend on the rows beside it. Two things make it per token:

- each row is divided by its own absolute maximum before the call (every row spans [-1, 1])
  and the output row multiplied back;
- two constant columns, +1 and -1, are appended to the input (their weight columns are zero),
  so the batch's min and max are always exactly -1 and +1: fbgemm's activation grid is the
  same for every batch.

A row's int8 codes then depend on that row alone, and int8 x int8 products summed in int32 are
exact, so a row's output is the same whatever else is in the batch, and the same on AVX2 and
AVX-512 (reduce_range keeps AVX2's 16-bit pair sums from saturating: activation codes run
-64..64 around fbgemm's zero point, step 2/127 of the row's maximum).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from engine.core.errors import ParamError
from engine.runtime.cpu import capabilities
from engine.runtime.cpu.block_linear import (
    BlockEmbedding,
    BlockLinear,
    BlockLinearParts,
    GreedyHead,
    quantize_q8_0,
    to_panels,
)
from engine.runtime.cpu.gguf_blocks import read_blocks
from engine.runtime.cpu.linear import replace_linears
from engine.runtime.cpu.native import NativeBuildError, load_library

logger = logging.getLogger(__name__)

_INT8_MAX = 127
_TINY = 1e-12  # an all-zero row keeps a finite scale (its output is the bias)


def can_quantize() -> bool:
    """Whether fbgemm runs here: in this torch build (every x86-64 CPU wheel) and on this CPU
    by the probe (KVSHARE_CPU_ISA=baseline says no, as a CPU without AVX2 would)."""
    has_fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    return has_fbgemm and bool(capabilities.levels_run_here(("avx2",)))  # fbgemm needs AVX2


_FP16_PAD = (0, 2, 1, 0, 0, 0)  # rows added for a row count of this remainder mod 6


class Fp16Linear(nn.Module):
    """y = x W^T + b with W held as float16 in fbgemm's layout; x and y are fp32 [N, *]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        bias = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fbgemm's AVX2 kernels take rows in blocks of 6, and a last block of 1 or 2 rows sums
        # in another order than the rest (on a Zen 3): padded to 3 rows, a row's output does
        # not depend on how many rows share the call.
        rows = x.reshape(-1, self.in_features)
        pad = _FP16_PAD[rows.shape[0] % 6]
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, self.in_features)])
        out = torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)
        return out[: out.shape[0] - pad].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16"


class Int8Linear(nn.Module):
    """y = x W^T + b with W held as per-output-channel int8; x is [N, in_features] fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = quantize_per_channel(weight.detach().float())
        # The two bound columns of the input meet zero weights: they move the grid, not y.
        codes = torch.cat([codes, codes.new_zeros(self.out_features, 2)], dim=1)
        self.packed = _prepack(codes, scales)
        self.bias = None if bias is None else bias.detach().float()
        self.register_buffer("bounds", torch.tensor([[1.0, -1.0]]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, K] -> per-token scale [N, 1]; normalized rows span [-1, 1] exactly.
        row_max = x.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY)
        normalized = torch.cat([x / row_max, self.bounds.expand(x.shape[0], 2)], dim=1)
        y = torch.ops.quantized.linear_dynamic(normalized, self.packed, True) * row_max
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [out, in] and their fp32 scales [out]: w ~= codes * scale."""
    scales = weight.abs().amax(dim=1).clamp_min(_TINY) / _INT8_MAX
    codes = torch.round(weight / scales[:, None]).clamp(-_INT8_MAX, _INT8_MAX)
    return codes.to(torch.int8), scales


def _prepack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    zero_points = torch.zeros(codes.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # fbgemm's prepack takes only a quantized tensor, whose constructors warn that they
        # are deprecated; the kernel itself is what we use (the warning is not for users).
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


LINEAR_CLASSES: dict[str, type[nn.Module]] = {"fp16": Fp16Linear, "int8": Int8Linear}


def quantize_model(
    model: nn.Module,
    mode: str,
    device: torch.device,
    dtype: torch.dtype,
    gguf_path: Path | None = None,
    kernels_dir: Path | None = None,
) -> int:
    """Apply `mode` to a loaded Llama-family model in place: every projection and the LM head
    (a tied head becomes a quantized copy of the embedding; the lookup keeps the fp32 table, or
    under native/q8_0 shares the head's blocks). `gguf_path`: the file the weights came from
    (native computes on its blocks); `kernels_dir`: where the native library is built.
    Returns the number of linears replaced (0 for "none", which leaves the model exact)."""
    if mode == "none":
        return 0
    if device.type != "cpu" or dtype != torch.float32:
        raise ParamError("quantization", f"quantization {mode} runs on the CPU in float32 only")
    if mode in ("native", "q8_0"):
        return _use_blocks(model, mode, gguf_path, kernels_dir)
    if not can_quantize():
        raise ParamError(
            "quantization", f"quantization {mode} needs fbgemm and an AVX2 CPU; use none"
        )
    linear_class = LINEAR_CLASSES[mode]
    count = replace_linears(model.model, linear_class)
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = linear_class(head, None)
    return count + 1


def _use_blocks(model: nn.Module, mode: str, gguf_path: Path | None, kernels_dir) -> int:
    try:
        library = load_library(kernels_dir or Path(".kernels"))
    except NativeBuildError as exc:
        if mode == "q8_0":
            message = f"quantization q8_0 needs the native kernels: {exc}"
            raise ParamError("quantization", message) from exc
        logger.warning("no native kernels (%s): quantization native runs the exact weights", exc)
        return 0
    if mode == "q8_0":
        blocks = _q8_0_blocks(model)
    elif gguf_path is None:
        logger.info(
            "quantization native: the weights are not GGUF blocks, so they run as loaded "
            "(exact); --quantization q8_0 or fp16 reads fewer bytes"
        )
        return 0
    else:
        spec = model.spec
        interleaved = getattr(model, "gguf_qk_rows_interleaved", True)
        blocks, skipped = read_blocks(gguf_path, spec.num_heads, spec.num_kv_heads, interleaved)
        if skipped:
            shown = ", ".join(f"{name} ({why})" for name, why in sorted(skipped.items()))
            logger.info("no block kernel, dequantized at load: %s", shown)
    return _replace_with_blocks(model, blocks, library)


def _q8_0_blocks(model: nn.Module) -> dict:
    blocks = {
        name: quantize_q8_0(module.weight)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module.in_features % 32 == 0
    }
    if model.lm_head is None and model.spec.hidden_size % 32 == 0:  # tied: the table's blocks
        blocks["model.embed_tokens"] = quantize_q8_0(model.model.embed_tokens.weight)
    return blocks


def _replace_with_blocks(model: nn.Module, blocks: dict, library) -> int:
    """Swap each named module for its block twin; a tied head reads the embedding's blocks.
    Weights whose rows come in whole panels are laid out as panels first (Q4_0, Q4_1, Q5_0,
    Q8_0: the same bytes, 1.7-2.5x faster than GGUF's row order; Q4_K, Q6_K: per group with
    their scales applied, 2.3-3.5x faster at 8 rows on Gemma 3; docs/cpu.md)."""
    tied = model.lm_head is None
    blocks = {
        name: tuple(map(to_panels, weight)) if isinstance(weight, tuple) else to_panels(weight)
        for name, weight in blocks.items()
    }
    for name, weight in blocks.items():
        if tied and name == "lm_head":
            continue  # the checkpoint's own head is unused when the config ties it
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        parts = weight if isinstance(weight, tuple) else (weight,)
        shape = (sum(w.out_features for w in parts), parts[0].in_features)
        if tuple(old.weight.shape) != shape:
            raise ValueError(
                f"GGUF tensor for {name} holds a {shape} weight, "
                f"expected a {tuple(old.weight.shape)} one"
            )
        if isinstance(old, nn.Embedding):
            new = BlockEmbedding(weight, library)
        elif len(parts) == 1:
            new = BlockLinear(weight, old.bias, library)
        else:  # a fused projection of several formats: a BlockLinear per run of rows
            rows = [w.out_features for w in parts]
            biases = [None] * len(parts) if old.bias is None else old.bias.split(rows)
            new = BlockLinearParts(
                [BlockLinear(w, b, library) for w, b in zip(parts, biases, strict=True)]
            )
        setattr(parent, child, new)
    if tied and "model.embed_tokens" in blocks:
        model.lm_head = BlockLinear(blocks["model.embed_tokens"], None, library)
    model.greedy_head = greedy_head(model.lm_head, library)
    return sum(isinstance(m, BlockLinear) for m in model.modules())


def greedy_head(head: nn.Module | None, library) -> GreedyHead | None:
    """A GreedyHead for a Q8_0 panel head where its estimate runs on VNNI (an AVX-512 build of
    the kernels on a CPU with VNNI and VBMI; about half the full head's time at 4-8 rows); None
    elsewhere, where the logits are computed."""
    if not isinstance(head, BlockLinear) or not library.kvshare_greedy_head_fast():
        return None
    try:
        return GreedyHead(head, library)
    except ValueError as exc:  # not Q8_0 panels, a bias, or rows that are not finite
        logger.info("greedy rows compute all the logits: %s", exc)
        return None
