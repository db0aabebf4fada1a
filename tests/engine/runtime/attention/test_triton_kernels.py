"""Triton kernels vs a naive paged reference, on the CPU through the Triton interpreter.

TRITON_INTERPRET=1 must be set before triton is imported (triton.jit picks the interpreter
when it decorates, triton's own library included), so it is set here, for the rest of the
session. If something imported triton earlier in this process, these tests run in a fresh
process instead. Shapes are tiny: the interpreter runs every program in Python.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests; test_triton_gpu.py covers CUDA", allow_module_level=True)

from tests.engine.runtime.attention.interpreter import (
    claim_interpreter,
    run_in_fresh_process,
)

_CAN_INTERPRET_HERE = claim_interpreter()
pytest.importorskip("triton")

from engine.runtime.attention import triton_cache_ops, triton_kernels  # noqa: E402
from engine.runtime.attention.triton_backend import TritonBackend  # noqa: E402
from tests.engine.runtime.attention.paged_reference import (  # noqa: E402
    PagedBatch,
    make_metadata,
    make_paged_batch,
    reference_attention,
    windowed_reference,
)

if _CAN_INTERPRET_HERE and not triton_kernels.INTERPRETED:
    # an earlier import (with triton already interpreting) built them for a GPU: rebuild
    importlib.reload(triton_kernels)
    importlib.reload(triton_cache_ops)

interpreted = pytest.mark.skipif(
    not _CAN_INTERPRET_HERE,
    reason="triton was imported before TRITON_INTERPRET=1; test_in_fresh_process runs these",
)


@pytest.mark.skipif(_CAN_INTERPRET_HERE, reason="the tests below run in this process")
def test_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


# (chunks as (cached_len, new_tokens), num_decodes, block_size, H, Hkv, D)
FORWARD_CASES = {
    "prefill-empty-prefix-bs8-gqa1": ([(0, 5), (0, 11)], 0, 8, 2, 2, 16),
    "prefill-cached-prefix-bs16-gqa2": ([(13, 6), (8, 1), (0, 20), (16, 16)], 0, 16, 4, 2, 16),
    "prefill-bs32-gqa4": ([(37, 9), (0, 3)], 0, 32, 8, 2, 16),
    "prefill-several-query-tiles-bs16": ([(70, 70)], 0, 16, 2, 2, 16),
    "decode-only-bs8-gqa4": ([(4, 1), (20, 1), (0, 1)], 3, 8, 8, 2, 16),
    "mixed-bs16-gqa2": ([(9, 1), (40, 1), (5, 7), (0, 4)], 2, 16, 4, 2, 16),
    "mixed-gqa3-head-dim-24": ([(7, 1), (11, 5)], 1, 8, 6, 2, 24),
}


def run_forward(
    batch: PagedBatch, num_splits: int | None = None, window: int | None = None
) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    backend = TritonBackend(num_splits=num_splits)
    return backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, window)


def reference_for(batch: PagedBatch) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    return reference_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_ids, batch.meta, scale
    )


@interpreted
@pytest.mark.parametrize("case", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_forward_matches_reference_fp32(case: tuple) -> None:
    chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim = case
    batch = make_paged_batch(chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim)
    out = run_forward(batch, num_splits=1)
    assert out.shape == batch.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, reference_for(batch), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2, 4, 8])
def test_split_k_decode_matches_reference(num_splits: int) -> None:
    # 300 keys = 5 tiles of 64: with 8 splits some slices are empty and must weigh nothing
    chunks = [(299, 1), (64, 1), (0, 1), (129, 1)]
    batch = make_paged_batch(chunks, 4, 16, num_heads=8, num_kv_heads=2, head_dim=16, seed=1)
    out = run_forward(batch, num_splits=num_splits)
    torch.testing.assert_close(out, reference_for(batch), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_half_precision_matches_reference(dtype: torch.dtype, num_splits: int) -> None:
    chunks = [(9, 1), (140, 1), (5, 7), (0, 4)]
    batch = make_paged_batch(chunks, 2, 16, 4, 2, 16, dtype=dtype, seed=2)
    out = run_forward(batch, num_splits=num_splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference_for(batch), atol=2e-2, rtol=2e-2)


@interpreted
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_row_with_empty_context_outputs_zeros(num_splits: int, window: int | None) -> None:
    # a padded decode row (seq_len 0, as CUDA-graph padding may produce) must not make NaNs
    batch = make_paged_batch([(5, 1), (3, 1)], 2, 8, 2, 1, 16, seed=3)
    expected = windowed_reference_for(batch, window)[0]
    batch.meta.seq_lens[1] = 0
    out = run_forward(batch, num_splits, window)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@interpreted
def test_store_then_forward_matches_reference() -> None:
    batch = make_paged_batch([(6, 1), (10, 6), (0, 9)], 1, 8, 4, 2, 16, seed=4)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping
    k_cache.view(-1, *k_cache.shape[2:])[slots] = 0.0  # forget the new tokens' K/V
    v_cache.view(-1, *v_cache.shape[2:])[slots] = 0.0
    backend = TritonBackend(num_splits=2)
    backend.store_kv(batch.key, batch.value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)
    out = backend.forward(batch.query, k_cache, v_cache, batch.meta, 0.25)
    torch.testing.assert_close(out, reference_for(batch), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(2, 16), (3, 24)])
def test_store_kv_writes_each_token_into_its_slot(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    num_tokens, num_heads = 5, 4
    # K and V as strided views of one fused qkv projection, as the model produces them
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = [3, block_size + 5, -1, 3 * block_size, 1]  # -1: a padding token
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[token]
            expected_v[slot // block_size, slot % block_size] = value[token]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    TritonBackend().store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_blocks_copies_in_every_layer(dtype: torch.dtype) -> None:
    shape = (6, 8, 2, 16)  # [num_blocks, block_size, Hkv, D]
    kv_caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(3)]
    expected = [(k.clone(), v.clone()) for k, v in kv_caches]
    src, dst = [1, 4], [5, 0]
    for k, v in expected:
        k[dst], v[dst] = k[src].clone(), v[src].clone()
    TritonBackend().copy_blocks(kv_caches, torch.tensor(src), torch.tensor(dst))
    for (k, v), (expected_k, expected_v) in zip(kv_caches, expected, strict=True):
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


@interpreted
def test_copy_blocks_without_pairs_changes_nothing() -> None:
    k, v = torch.randn(3, 8, 1, 16), torch.randn(3, 8, 1, 16)
    before = (k.clone(), v.clone())
    empty = torch.empty(0, dtype=torch.int64)
    TritonBackend().copy_blocks([(k, v)], empty, empty)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


@pytest.mark.parametrize(
    ("num_decodes", "num_kv_heads", "max_seq_len", "expected"),
    [
        (1, 1, 4096, 8),  # 4 "SMs" on the CPU: 2 * 4 programs wanted
        (1, 1, 300, 1),  # too short to split
        (1, 3, 4096, 2),  # ceil(8 / 3) = 3, rounded down to a power of two
        (64, 8, 4096, 1),  # the batch already fills the device
        (1, 1, 10**6, 8),
    ],
)
def test_choose_num_splits(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, expected: int
) -> None:
    backend = TritonBackend()
    got = backend.choose_num_splits(num_decodes, num_kv_heads, max_seq_len, torch.device("cpu"))
    assert got == expected


@interpreted
def test_matches_torch_reference_backend() -> None:
    torch_ref = pytest.importorskip("engine.runtime.attention.torch_ref")
    batch = make_paged_batch([(9, 1), (70, 1), (5, 7), (0, 4)], 2, 16, 4, 2, 16, seed=5)
    reference = torch_ref.TorchRefBackend()
    expected = reference.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    out = TritonBackend().forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def windowed_reference_for(batch: PagedBatch, window: int | None) -> torch.Tensor:
    """The float64 oracle, as fp32 to compare with the kernels' fp32 output."""
    scale = batch.query.shape[-1] ** -0.5
    return windowed_reference(
        batch.query, batch.k_cache, batch.v_cache, batch.block_ids, batch.meta, scale, window
    ).float()


# Block size 8 below: contexts and windows end on a block edge (8, 16, 40) or one past it.
WINDOW_DECODE_CONTEXTS = [1, 8, 9, 16, 17, 40, 300]
# (window, num_splits): 8 splits leave most slices without a key; windows over one tile (64
# keys at D = 16) also split into several non-empty slices
WINDOW_DECODE_SPLITS = [(w, s) for w in (1, 8, 9, 16, 17, 100, 400) for s in (1, 8)]


@interpreted
@pytest.mark.parametrize(("window", "num_splits"), [*WINDOW_DECODE_SPLITS, (100, 3), (400, 3)])
def test_windowed_decode_matches_reference(window: int, num_splits: int) -> None:
    # windows below, at and above each context
    chunks = [(n - 1, 1) for n in WINDOW_DECODE_CONTEXTS]
    batch = make_paged_batch(chunks, len(chunks), 8, num_heads=4, num_kv_heads=1, head_dim=16)
    out = run_forward(batch, num_splits, window)
    torch.testing.assert_close(out, windowed_reference_for(batch, window), atol=1e-5, rtol=1e-5)


# (cached_len, new_tokens): contexts 40, 25, 17, 40, 8, 65; the 40-token chunks span 3 tiles
WINDOW_PREFILL_CHUNKS = [(0, 40), (16, 9), (13, 4), (30, 10), (0, 8), (64, 1)]


@interpreted
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (6, 2)])
@pytest.mark.parametrize("window", [1, 8, 9, 16, 17, 40, 100])
def test_windowed_prefill_matches_reference(window: int, num_heads: int, num_kv_heads: int) -> None:
    chunks = WINDOW_PREFILL_CHUNKS
    batch = make_paged_batch(chunks, 0, 8, num_heads, num_kv_heads, head_dim=16, seed=6)
    out = run_forward(batch, window=window)
    torch.testing.assert_close(out, windowed_reference_for(batch, window), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("window", [7, 16, 33])
def test_windowed_prefill_in_chunks_equals_one_chunk(window: int) -> None:
    # chunk edges on and off the blocks (8) and the query tiles (16 tokens at group 4)
    batch = make_paged_batch([(0, 70)], 0, 8, 8, 2, 16, seed=7)
    scale = 16**-0.5
    backend = TritonBackend()
    whole = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, window)
    parts = []
    for start, end in [(0, 16), (16, 17), (17, 41), (41, 70)]:
        slots = batch.meta.slot_mapping[start:end].tolist()
        meta = make_metadata([(start, end - start)], 0, batch.block_ids, slots)
        query = batch.query[start:end]
        parts.append(backend.forward(query, batch.k_cache, batch.v_cache, meta, scale, window))
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(whole, windowed_reference_for(batch, window), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 4])
def test_windowed_kernels_never_read_keys_before_the_window(num_splits: int) -> None:
    # NaN in every slot before the first key a sequence's queries see: one read would show
    window, block_size = 12, 8
    chunks = [(99, 1), (16, 1), (30, 1), (37, 9), (4, 20)]
    batch = make_paged_batch(chunks, 3, block_size, 4, 2, 16, seed=8)
    expected = windowed_reference_for(batch, window)
    for (cached_len, _), table in zip(chunks, batch.block_ids, strict=True):
        for position in range(max(0, cached_len - window + 1)):
            block, offset = table[position // block_size], position % block_size
            batch.k_cache[block, offset] = float("nan")
            batch.v_cache[block, offset] = float("nan")
    out = run_forward(batch, num_splits, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_head_dim_256_group_4(num_splits: int, window: int | None) -> None:
    # Gemma 3's attention shape (narrow tiles at D = 256), decodes and prefills in one batch
    chunks = [(99, 1), (40, 1), (50, 30), (0, 20)]
    batch = make_paged_batch(chunks, 2, 16, num_heads=8, num_kv_heads=2, head_dim=256, seed=9)
    out = run_forward(batch, num_splits, window)
    torch.testing.assert_close(out, windowed_reference_for(batch, window), atol=1e-5, rtol=1e-5)


@interpreted
def test_window_below_one_is_rejected() -> None:
    batch = make_paged_batch([(3, 1)], 1, 8, 2, 1, 16)
    with pytest.raises(ValueError, match="window"):
        run_forward(batch, window=0)
