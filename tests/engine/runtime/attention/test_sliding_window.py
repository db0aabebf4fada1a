"""Sliding-window attention (Gemma 3's local layers) on the CPU backends: the torch reference and
the native paged kernel at every build level this CPU runs, against a dense float64 oracle
(paged_reference.windowed_reference) and against each other.

A query at position p sees keys max(0, p - W + 1) .. p. The cases put windows below, at and
above the context, with contexts and windows ending exactly on a block edge or one past it, in
decode rows, prefill chunks and both in one batch.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

from engine.runtime.attention import cpu_native
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.cpu.capabilities import available_isa_levels
from tests.engine.runtime.attention.paged_reference import (
    PagedBatch,
    make_metadata,
    make_paged_batch,
    windowed_reference,
)

pytestmark = pytest.mark.usefixtures("single_thread")

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
LEVELS = [pytest.param(level, marks=needs_compiler) for level in available_isa_levels()]


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The session's, shared with test_cpu_native.py: each level compiles once per run.
    return tmp_path_factory.getbasetemp() / "native-kernels"


@pytest.fixture(scope="module", params=LEVELS)
def native(request: pytest.FixtureRequest, build_dir: Path) -> cpu_native.CpuNativeBackend:
    """The native backend of each kernel build level whose code runs on this CPU."""
    return cpu_native.create_backend(build_dir, request.param)


@pytest.fixture(scope="module", params=["torch", *LEVELS])
def backend(request: pytest.FixtureRequest, build_dir: Path) -> TorchRefBackend:
    """The torch reference, then the native backend of each level."""
    if request.param == "torch":
        return TorchRefBackend()
    return cpu_native.create_backend(build_dir, request.param)


def run(backend, batch: PagedBatch, window: int | None, k_cache=None, v_cache=None):
    k_cache = batch.k_cache if k_cache is None else k_cache
    v_cache = batch.v_cache if v_cache is None else v_cache
    scale = batch.query.shape[-1] ** -0.5
    return backend.forward(batch.query, k_cache, v_cache, batch.meta, scale, window)


def oracle(batch: PagedBatch, window: int | None, k_cache=None, v_cache=None) -> torch.Tensor:
    k_cache = batch.k_cache if k_cache is None else k_cache
    v_cache = batch.v_cache if v_cache is None else v_cache
    scale = batch.query.shape[-1] ** -0.5
    out = windowed_reference(
        batch.query, k_cache, v_cache, batch.block_ids, batch.meta, scale, window
    )
    return out.float()


# Contexts (positions after the step) on and one past block edges of 8 and 16, and far past.
DECODE_CONTEXTS = [1, 8, 9, 15, 16, 17, 32, 33, 100, 300]
WINDOWS = [1, 8, 9, 16, 17, 32, 33, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_decodes_match_the_dense_oracle(backend, block_size: int, window: int) -> None:
    chunks = [(n - 1, 1) for n in DECODE_CONTEXTS]
    batch = make_paged_batch(chunks, len(chunks), block_size, 6, 2, 64, seed=block_size)
    torch.testing.assert_close(
        run(backend, batch, window), oracle(batch, window), atol=1e-5, rtol=1e-5
    )


# Decodes first, then chunks: a whole prompt, chunks starting on and off block edges, one that
# crosses two blocks, one of a single token (cached_len, new_tokens).
MIXED = [(47, 1), (15, 1), (0, 40), (16, 17), (13, 4), (31, 33), (64, 1), (100, 20)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_mixed_decode_and_prefill_batches_match_the_dense_oracle(
    backend, block_size: int, window: int
) -> None:
    batch = make_paged_batch(MIXED, 2, block_size, 6, 2, 64, seed=3)
    torch.testing.assert_close(
        run(backend, batch, window), oracle(batch, window), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_caches_match_the_dense_oracle(backend, cache_dtype: torch.dtype) -> None:
    """bf16 activations over a bf16 cache, and fp32 activations over an fp16 cache."""
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    batch = make_paged_batch(MIXED, 2, 16, 6, 2, 64, dtype=dtype, seed=4)
    k_cache, v_cache = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    out = run(backend, batch, 17, k_cache, v_cache)
    expected = oracle(batch, 17, k_cache, v_cache)
    assert out.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def in_chunks(backend, batch: PagedBatch, edges: list[int], window: int | None) -> torch.Tensor:
    """The one prompt of `batch` as chunks [edges[i], edges[i + 1]), each over the cache the
    ones before it filled."""
    scale = batch.query.shape[-1] ** -0.5
    parts = []
    for start, end in itertools.pairwise(edges):
        slots = batch.meta.slot_mapping[start:end].tolist()
        meta = make_metadata([(start, end - start)], 0, batch.block_ids, slots)
        query = batch.query[start:end]
        parts.append(backend.forward(query, batch.k_cache, batch.v_cache, meta, scale, window))
    return torch.cat(parts)


# Chunk edges on and off the blocks (8), the first chunk the whole prompt.
CHUNKINGS = [[0, 70], [0, 16, 17, 41, 70], [0, 1, 2, 9, 33, 69, 70]]


@pytest.mark.parametrize("window", [7, 16, 33, None])
def test_a_prompt_in_chunks_is_the_prompt_in_one(backend, window: int | None) -> None:
    """The native kernel computes a query the same way in any chunk: the same bits too."""
    batch = make_paged_batch([(0, 70)], 0, 8, 6, 2, 64, seed=5)
    outs = [in_chunks(backend, batch, edges, window) for edges in CHUNKINGS]
    for edges, out in zip(CHUNKINGS, outs, strict=True):
        torch.testing.assert_close(out, oracle(batch, window), atol=1e-5, rtol=1e-5)
        if isinstance(backend, cpu_native.CpuNativeBackend):
            assert torch.equal(out, outs[0]), edges


# Gemma 3 1B: head_dim 256, 4 query heads on 1 KV head, a window of 512; its larger sizes have
# groups of 2. Contexts on both sides of the window, decodes and chunks that cross it.
GEMMA_CHUNKS = [(510, 1), (511, 1), (512, 1), (1030, 1), (500, 30), (0, 20)]


@pytest.mark.parametrize("window", [512, None])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 1), (8, 4)], ids=["gqa4", "gqa2"])
def test_head_dim_256(
    backend, monkeypatch: pytest.MonkeyPatch, num_heads: int, num_kv_heads: int, window: int | None
) -> None:
    batch = make_paged_batch(GEMMA_CHUNKS, 4, 16, num_heads, num_kv_heads, 256, seed=6)
    is_native, calls = isinstance(backend, cpu_native.CpuNativeBackend), []
    if is_native:
        kernel = backend._decode_fn
        monkeypatch.setattr(backend, "_decode_fn", lambda *a: calls.append(a) or kernel(*a))
    out = run(backend, batch, window)
    torch.testing.assert_close(out, oracle(batch, window), atol=1e-5, rtol=1e-5)
    assert len(calls) == (3 if is_native else 0)  # native: the decodes and both chunks in it


@pytest.mark.parametrize("window", [40, None])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("head_dim", "group"), [(256, 1), (256, 2), (256, 4), (256, 8), (128, 3), (128, 5), (128, 8)]
)
def test_wide_heads_score_the_same_bits_in_tiles_as_token_by_token(
    native, head_dim: int, group: int, block_size: int, window: int | None
) -> None:
    """A chunk's rows after its first find their context in cache and, on AVX-512, score it in
    16-token tiles (paged_attention.cpp: score_tile_wide at D 256, and at D 128 past the
    register budget, groups 3 to 8, in passes of up to 4 heads); the same query as a decode of
    its own, cold, scores it token by token: the same bits, full and partial tiles."""
    cached, new = 70, 30
    batch = make_paged_batch([(cached, new)], 0, block_size, group, 1, head_dim, seed=group)
    chunk = run(native, batch, window)
    for row in (1, 9, new - 1):
        meta = make_metadata([(cached + row, 1)], 1, batch.block_ids, [0])
        scale = head_dim**-0.5
        query = batch.query[row : row + 1]
        decode = native.forward(query, batch.k_cache, batch.v_cache, meta, scale, window)
        assert torch.equal(decode[0], chunk[row]), row


@pytest.mark.parametrize("window", [17, 512, None])
def test_native_matches_the_torch_reference(native, window: int | None) -> None:
    batch = make_paged_batch(GEMMA_CHUNKS, 4, 16, 4, 1, 256, dtype=torch.bfloat16, seed=7)
    expected = run(TorchRefBackend(), batch, window)
    torch.testing.assert_close(run(native, batch, window), expected, atol=2e-2, rtol=2e-2)


def last_rows(batch: PagedBatch) -> list[int]:
    return [end - 1 for end in batch.meta.query_start_loc_host[1:]]


@pytest.mark.parametrize("window", [1, 16, 17, 40])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_window_is_full_attention_with_the_keys_before_it_masked_bit_for_bit(
    native, block_size: int, window: int, cache_dtype: torch.dtype
) -> None:
    """The kernel keeps every score in its lane and starts the softmax at the vector holding the
    window's first position: the same bits as full attention over keys so far below the rest
    (-50 against queries > 0, more than 87 under the top score) that their weights are 0.
    Checked on each sequence's last row: a decode's, and a chunk's (its context in cache, so
    scored in tiles on AVX-512 at block 16)."""
    chunks = [(47, 1), (16, 1), (32, 1), (33, 1), (100, 1), (30, 3), (64, 2)]
    batch = make_paged_batch(chunks, 5, block_size, 6, 2, 64, seed=8)
    batch.query = batch.query.abs() + 0.1
    masked = batch.k_cache.clone()
    for seq_len, table in zip(batch.meta.seq_lens_host, batch.block_ids, strict=True):
        for position in range(max(0, seq_len - window)):
            masked[table[position // block_size], position % block_size] = -50.0
    v_cache = batch.v_cache.to(cache_dtype)
    windowed = run(native, batch, window, batch.k_cache.to(cache_dtype), v_cache)
    full = run(native, batch, None, masked.to(cache_dtype), v_cache)
    rows = last_rows(batch)
    assert torch.equal(windowed[rows], full[rows])
    assert not torch.equal(windowed[rows], run(native, batch, None)[rows])  # the mask matters


@pytest.mark.parametrize("block_size", [8, 16])
def test_the_kernel_reads_no_value_before_the_window(native, block_size: int) -> None:
    """NaN in every K and V slot before the first position any query of a sequence sees: one
    read into the result would show. (Keys of the window's first block are scored, then
    masked; its values before the window, and every earlier block, are never read.)"""
    window = 12
    chunks = [(99, 1), (16, 1), (30, 1), (37, 9), (4, 20)]
    batch = make_paged_batch(chunks, 3, block_size, 6, 2, 64, seed=9)
    expected = oracle(batch, window)
    starts = batch.meta.query_start_loc_host
    for seq, table in enumerate(batch.block_ids):
        first_query_len = batch.meta.seq_lens_host[seq] - (starts[seq + 1] - starts[seq]) + 1
        for position in range(max(0, first_query_len - window)):
            batch.k_cache[table[position // block_size], position % block_size] = float("nan")
            batch.v_cache[table[position // block_size], position % block_size] = float("nan")
    torch.testing.assert_close(run(native, batch, window), expected, atol=1e-5, rtol=1e-5)


# (head_dim, group) -> covered: every group to 8 at D 64 and 128, the powers of two at 256.
SHAPES = {
    (64, 3): True,
    (128, 8): True,
    (256, 1): True,
    (256, 2): True,
    (256, 3): False,
    (256, 4): True,
    (256, 6): False,
    (256, 8): True,
    (256, 16): False,
    (32, 1): False,
}


@pytest.mark.parametrize(("shape", "covered"), SHAPES.items(), ids=map(str, SHAPES))
def test_the_kernel_covers_these_shapes(native, shape: tuple[int, int], covered: bool) -> None:
    assert native._supports_shape(*shape) == int(covered)


def test_an_uncovered_group_at_head_dim_256_takes_the_torch_path_with_its_window(
    native, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = make_paged_batch(GEMMA_CHUNKS, 4, 16, 6, 2, 256, seed=10)  # group 3
    calls = []
    monkeypatch.setattr(native, "_decode_fn", lambda *args: calls.append(args) or 0)
    out = run(native, batch, 512)
    assert calls == []
    torch.testing.assert_close(out, oracle(batch, 512), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_below_one_is_refused(backend, window: int) -> None:
    batch = make_paged_batch([(9, 1), (0, 5)], 1, 8, 4, 2, 64)
    with pytest.raises(ValueError, match="window"):
        run(backend, batch, window)


def test_the_kernel_refuses_a_negative_window(native) -> None:
    # Before it reads a pointer: 2, as for a shape it does not cover.
    status = native._decode_fn(0, 0, None, None, None, None, None, None, 1, 4, 2, 64, 8, 2, 1.0,
                               1, -1)  # fmt: skip
    assert status == 2
