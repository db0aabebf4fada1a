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

from pathlib import Path

import numpy as np
import torch

from engine.runtime.cpu.block_linear import BLOCK_FORMATS, BlockWeight, format_runs

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
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    parts: dict[str, dict[int, BlockWeight]] = {}
    skipped: dict[str, str] = {}
    for tensor in reader.tensors:
        name, fmt = tensor.name.removesuffix(".weight"), tensor.tensor_type.name
        target = _module_of(name)
        if target is None or not tensor.name.endswith(".weight"):
            continue
        module, part = target
        if fmt not in BLOCK_FORMATS:
            skipped[tensor.name] = fmt
            continue
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # [rows, row bytes]
        in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        if qk_rows_interleaved and name.endswith(("attn_q", "attn_k")):
            data = data[_hf_row_order(data.shape[0], num_heads, num_kv_heads, name)]
        parts.setdefault(module, {})[part] = BlockWeight(fmt, data.contiguous(), in_features)
    return _fuse(parts, skipped), skipped


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
