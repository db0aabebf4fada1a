"""Triton kernels vs the naive paged reference on a CUDA device, at realistic shapes (bf16).

Skipped without CUDA (the gpu marker) or compiled Triton (tests/conftest.py). The CPU
interpreter tests (test_triton_kernels.py) cover the same kernels on tiny shapes; these check
compiled code, real head dims and long contexts.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.runtime.attention.paged_reference import (
    PagedBatch,
    make_paged_batch,
    reference_attention,
    windowed_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_triton")]

BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


def triton_backend(**kwargs):
    """A TritonBackend. Imported here, when a test runs: importing triton while collecting
    would load it outside the interpreter (see compiled_triton in tests/conftest.py)."""
    from engine.runtime.attention.triton_backend import TritonBackend

    return TritonBackend(**kwargs)


def random_chunks(num_seqs: int, max_cached: int, max_new: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    return [(rng.randint(0, max_cached), rng.randint(1, max_new)) for _ in range(num_seqs)]


def check_forward(
    batch: PagedBatch, num_splits: int | None = None, window: int | None = None
) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = triton_backend(num_splits=num_splits).forward(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, window
    )
    torch.cuda.synchronize()
    if window is None:
        expected = reference_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.block_ids, batch.meta, scale
        )
    else:
        expected = windowed_reference(
            batch.query, batch.k_cache, batch.v_cache, batch.block_ids, batch.meta, scale, window
        ).float()
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float().cpu(), expected, **BF16_TOL)


@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(16, 32, 8, 128), (32, 16, 16, 64), (8, 8, 1, 128)],
)
def test_decode_long_contexts(
    num_splits: int | None, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    chunks = [(c, 1) for c in (4095, 1, 17, 2048, 1000, 3333, 63, 64)]
    batch = make_paged_batch(
        chunks, len(chunks), block_size, num_heads, num_kv_heads, head_dim,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    check_forward(batch, num_splits)


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim"),
    [(16, 32, 8, 128), (32, 16, 16, 64), (16, 28, 4, 128)],  # the last: 7 query heads per KV head
)
def test_prefill_with_cached_prefix(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    chunks = [(0, 512), (1000, 300), (3000, 77), (15, 1), *random_chunks(4, 2000, 200, seed=0)]
    batch = make_paged_batch(
        chunks, 0, block_size, num_heads, num_kv_heads, head_dim,
        dtype=torch.bfloat16, device="cuda", seed=1,
    )  # fmt: skip
    check_forward(batch)


@pytest.mark.parametrize(("num_splits", "window"), [(None, None), (None, 512), (1, 512), (8, 512)])
def test_gemma3_shape_with_sliding_window(num_splits: int | None, window: int | None) -> None:
    # head_dim 256, 4 query heads per KV head; contexts below, at, one past and far past 512
    decodes = [(c, 1) for c in (4095, 511, 512, 1000, 20)]
    chunks = [*decodes, (0, 700), (3000, 300), (505, 13), (16, 1)]
    batch = make_paged_batch(
        chunks, len(decodes), 16, 16, 4, 256, dtype=torch.bfloat16, device="cuda", seed=4
    )
    check_forward(batch, num_splits, window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch(dtype: torch.dtype) -> None:
    decodes = [(c, 1) for c in (4000, 5, 700)]
    chunks = [*decodes, *random_chunks(5, 3000, 256, seed=2)]
    batch = make_paged_batch(chunks, 3, 16, 32, 8, 128, dtype=dtype, device="cuda", seed=3)
    check_forward(batch)


def test_decode_replays_in_a_cuda_graph() -> None:
    # capture once, then change the (static) inputs in place: the replay must follow them
    chunks = [(c, 1) for c in (900, 33, 2500, 7)]
    batch = make_paged_batch(chunks, 4, 16, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    backend = triton_backend(num_splits=4)
    scale = 128**-0.5
    backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    shorter = [n - 5 for n in batch.meta.seq_lens_host]
    batch.meta.seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
    batch.meta.seq_lens_host[:] = shorter
    batch.query.normal_()
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_ids, batch.meta, scale
    )
    torch.testing.assert_close(out.float().cpu(), expected, **BF16_TOL)


def test_store_kv_and_copy_blocks_are_exact() -> None:
    num_tokens, num_kv_heads, head_dim, block_size = 1000, 8, 128, 16
    shape = (128, block_size, num_kv_heads, head_dim)
    kv_caches = [
        (torch.randn(shape, device="cuda").bfloat16(), torch.randn(shape, device="cuda").bfloat16())
        for _ in range(16)
    ]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda").bfloat16()
    value = torch.randn_like(key)
    slots = torch.randperm(128 * block_size, device="cuda")[:num_tokens]
    slots[::10] = -1  # padding tokens
    k_cache, v_cache = kv_caches[0]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = key[keep]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = value[keep]
    backend = triton_backend()
    backend.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)

    src = torch.tensor([3, 90, 17], device="cuda")
    dst = torch.tensor([100, 4, 127], device="cuda")
    expected = [(k.clone(), v.clone()) for k, v in kv_caches]
    for k, v in expected:
        k[dst], v[dst] = k[src].clone(), v[src].clone()
    backend.copy_blocks(kv_caches, src, dst)
    for (k, v), (ek, ev) in zip(kv_caches, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)
