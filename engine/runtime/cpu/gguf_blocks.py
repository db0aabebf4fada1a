"""The projections and embedding of a GGUF file as stored: its blocks, mapped to our layers.

A Llama-family GGUF names its tensors blk.{i}.attn_q.weight and so on; each maps to one of our
fused parameters (q, k, v rows stack into qkv_proj, gate and up into gate_up_proj). llama.cpp's
converter reorders the rows of q and k within each head for its rope layout; the HF layout is
restored here by moving whole rows, which leaves every block intact. A fused projection whose
parts come in different formats (Gemma 3's v in Q8_0 beside q and k in Q5_0) maps to a tuple of
BlockWeights, one per run of rows of one format (BlockLinearParts computes it). Tensors in a
format the block kernels have no kernel for are left out: the caller keeps those layers on the
dequantized weights and says so in the log.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from engine.core.errors import ModelLoadError
from engine.runtime.cpu.block_linear import BLOCK_FORMATS, BlockWeight, format_runs
from engine.runtime.cpu.gguf_header import GgufTensor, read_header

# GGUF tensor name (after blk.{i}.) -> (our module under layers.{i}, part index in the fused rows)
_LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output": "lm_head"}


def read_blocks(
    path: Path, num_heads: int, num_kv_heads: int, qk_rows_interleaved: bool = True
) -> tuple[dict, dict[str, str]]:
    """({module name: BlockWeight, or a tuple of them for a fused projection of several
    formats}, {GGUF tensor or module: why it has no block kernel}).

    Module names are those of LlamaForCausalLM (model.layers.0.self_attn.qkv_proj, lm_head,
    model.embed_tokens). qk_rows_interleaved: the file holds q and k in llama.cpp's rope layout
    (its Llama family does; its Gemma keeps the HF order). The data are copies: the file's
    mapping is not kept."""
    parts: dict[str, dict[int, BlockWeight]] = {}
    skipped: dict[str, str] = {}
    for full_name, fmt, in_features, raw in _tensors(path):
        name = full_name.removesuffix(".weight")
        target = _module_of(name)
        if target is None or not full_name.endswith(".weight"):
            continue
        module, part = target
        if fmt not in BLOCK_FORMATS:
            skipped[full_name] = fmt
            continue
        data = torch.from_numpy(np.array(raw(), dtype=np.uint8))  # a copy: [rows, row bytes]
        if qk_rows_interleaved and name.endswith(("attn_q", "attn_k")):
            data = data[_hf_row_order(data.shape[0], num_heads, num_kv_heads, name)]
        parts.setdefault(module, {})[part] = BlockWeight(fmt, data.contiguous(), in_features)
    return _fuse(parts, skipped), skipped


def _tensors(path: Path) -> Iterator[tuple[str, str, int, Callable[[], np.ndarray]]]:
    """(name, ggml type name, row length, its bytes [rows, row bytes] mapped from the file, when
    called) per tensor, from the fast header (gguf_header.py: 0.8 s to read Gemma 3 270M's
    blocks, 10.2 s through gguf-py's GGUFReader; SmolLM2's 0.8 s and 2.8 s), or GGUFReader
    where it fails."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    header = read_header(path)
    if header is None:
        from gguf import GGUFReader

        for tensor in GGUFReader(str(path)).tensors:
            # GGUF lists dimensions innermost first
            data = tensor.data
            yield tensor.name, tensor.tensor_type.name, int(tensor.shape[0]), lambda d=data: d
        return
    blob = np.memmap(path, mode="r", dtype=np.uint8)

    def mapped(tensor: GgufTensor, qtype: GGMLQuantizationType) -> np.ndarray:
        per_block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, row_bytes = math.prod(tensor.shape[:-1]), tensor.shape[-1] // per_block * block_bytes
        start = header.data_start + tensor.offset
        if start + rows * row_bytes > blob.size:
            raise ModelLoadError(f"{path} ends inside its tensor {tensor.name}: truncated?")
        return blob[start : start + rows * row_bytes].reshape(rows, row_bytes)

    for tensor in header.tensors:
        try:
            qtype = GGMLQuantizationType(tensor.ggml_type)
        except ValueError:  # a type this gguf-py does not know: no kernel for it either
            yield tensor.name, f"ggml type {tensor.ggml_type}", tensor.shape[-1], lambda: None
            continue
        yield tensor.name, qtype.name, tensor.shape[-1], partial(mapped, tensor, qtype)


def _module_of(name: str) -> tuple[str, int] | None:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name], 0
    prefix, _, rest = name.partition(".")
    index, _, kind = rest.partition(".")
    if prefix != "blk" or kind not in _LAYER_TENSORS:
        return None
    module, part = _LAYER_TENSORS[kind]
    return f"model.layers.{int(index)}.{module}", part


def _fuse(parts: dict[str, dict[int, BlockWeight]], skipped: dict[str, str]) -> dict:
    fused = {}
    for module, by_part in parts.items():
        expected = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
        if len(by_part) != expected:
            skipped[module] = "a fused part has no block kernel"
            continue
        runs = format_runs([by_part[i] for i in range(expected)])
        if runs is None:
            skipped[module] = "its fused parts differ in row length"
            continue
        fused[module] = runs[0] if len(runs) == 1 else tuple(runs)
    return fused


def _hf_row_order(rows: int, num_heads: int, num_kv_heads: int, name: str) -> torch.Tensor:
    """Row indices that take llama.cpp's rope layout of q or k back to the HF layout: within each
    head, the GGUF rows interleave the two rotated halves (pairs), HF keeps the halves apart."""
    heads = num_kv_heads if name.endswith("attn_k") else num_heads
    half = rows // heads // 2
    # GGUF row (h, i, j) with i < half, j < 2 holds HF row (h, j, i).
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
