"""The native CPU decode kernel vs the naive paged reference (decodes, and prefill chunks, whose
queries it computes as decode queries), and how it is built and chosen.

The reference comparisons run once per kernel build level this CPU executes (the probe's
available_isa_levels(): native, avx512, avx2 and baseline on an AVX-512 CPU), so the levels an
AVX2-only CPU gets are checked here too.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine.runtime.attention import cpu_native
from engine.runtime.attention.select import get_attention_backend
from engine.runtime.attention.torch_ref import TorchRefBackend
from engine.runtime.cpu import capabilities, native
from engine.runtime.cpu.capabilities import CpuCapabilities, available_isa_levels, probe
from tests.engine.runtime.attention.paged_reference import (
    make_metadata,
    make_paged_batch,
    reference_attention,
)

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The session's, shared with test_cpu_fused.py: each level compiles once per run (~10 s).
    return tmp_path_factory.getbasetemp() / "native-kernels"


@pytest.fixture(scope="module")
def backend(build_dir: Path) -> cpu_native.CpuNativeBackend:
    """The default build (the probe's kernel_isa), for the tests of what reaches the kernel."""
    return cpu_native.create_backend(build_dir)


@pytest.fixture(scope="module", params=available_isa_levels())
def isa_backend(request: pytest.FixtureRequest, build_dir: Path) -> cpu_native.CpuNativeBackend:
    """One backend per kernel build level whose code runs on this CPU."""
    return cpu_native.create_backend(build_dir, request.param)


def forward_and_reference(backend, batch) -> tuple[torch.Tensor, torch.Tensor]:
    scale = batch.query.shape[-1] ** -0.5
    out = backend.forward(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    expected = reference_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.block_ids, batch.meta, scale
    )
    return out, expected


# (chunks as (cached_len, new_tokens), num_decodes, block_size, H, Hkv, D); decodes first.
DECODE_CASES = {
    "bs16-gqa3-d64-mid-block": ([(244, 1), (16, 1), (0, 1), (30, 1)], 4, 16, 9, 3, 64),
    "bs8-gqa1-d64": ([(7, 1), (64, 1)], 2, 8, 4, 4, 64),
    "bs32-gqa4-d128-long": ([(700, 1), (33, 1), (95, 1)], 3, 32, 8, 2, 128),
    "bs16-gqa7-d64": ([(50, 1), (17, 1)], 2, 16, 14, 2, 64),
    "bs16-gqa8-d128": ([(40, 1)], 1, 16, 8, 1, 128),
    "bs16-gqa2-d128-one-token-context": ([(0, 1), (1, 1)], 2, 16, 4, 2, 128),
    "mixed-with-prefills": ([(9, 1), (40, 1), (5, 7), (0, 4)], 2, 16, 6, 2, 64),
    # prefill chunks, first (cached 0) and continuing, as decode queries
    "continuation-chunks": ([(300, 16), (40, 64), (0, 9), (15, 1)], 0, 16, 9, 3, 64),
    "decodes-and-a-long-continuation": ([(33, 1), (700, 40)], 1, 32, 8, 2, 128),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_matches_reference(isa_backend, case: tuple, dtype: torch.dtype) -> None:
    chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim = case
    batch = make_paged_batch(
        chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim, dtype=dtype
    )
    out, expected = forward_and_reference(isa_backend, batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_fp32_queries_over_a_half_precision_cache(
    isa_backend, monkeypatch: pytest.MonkeyPatch, case: tuple, cache_dtype: torch.dtype
) -> None:
    """kv_cache_dtype float16 / bfloat16 under a float32 model: the kernel reads the rounded
    K/V and computes in fp32, so it matches the reference on those same values up to
    summation order."""
    chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim = case
    batch = make_paged_batch(chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim)
    k_cache, v_cache = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    kernel, calls = isa_backend._decode_fn, []
    monkeypatch.setattr(isa_backend, "_decode_fn", lambda *a: calls.append(a[1]) or kernel(*a))
    scale = head_dim**-0.5
    out = isa_backend.forward(batch.query, k_cache, v_cache, batch.meta, scale)
    expected = reference_attention(
        batch.query, k_cache.float(), v_cache.float(), batch.block_ids, batch.meta, scale
    )
    assert calls and set(calls) == {native.CACHE_DTYPE_CODES[cache_dtype]}  # in the kernel
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("two_threads")
def test_many_sequences_split_whole_sequences_over_threads(isa_backend) -> None:
    # 32 decodes >= 2 per thread: the kernel gives each task a whole sequence, not one KV head
    chunks = [(17 * i % 90, 1) for i in range(32)]
    batch = make_paged_batch(chunks, 32, 16, 9, 3, 64, dtype=torch.bfloat16, seed=7)
    out, expected = forward_and_reference(isa_backend, batch)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_row_is_the_same_bits_alone_and_among_many(isa_backend, cache_dtype) -> None:
    """Alone, a sequence's KV heads are tasks of their own, dealt to the threads; among 8, the
    sequence is one task. Either way each of its rows sums in the same order."""
    chunks = [(37 * i % 300 + 20, 1) for i in range(8)]
    batch = make_paged_batch(chunks, 8, 16, 9, 3, 64, seed=11)
    k_cache, v_cache = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    scale = 64**-0.5
    together = isa_backend.forward(batch.query, k_cache, v_cache, batch.meta, scale)
    for row in (0, 5):
        alone = make_metadata([chunks[row]], 1, [batch.block_ids[row]], [0], "cpu")
        out = isa_backend.forward(batch.query[row : row + 1], k_cache, v_cache, alone, scale)
        assert torch.equal(out[0], together[row])


@pytest.mark.skipif(
    not {"avx512", "avx2"} <= set(available_isa_levels()), reason="needs an AVX-512 CPU"
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_avx512_score_tiles_sum_as_avx2_does_token_by_token(
    build_dir: Path, case: tuple, cache_dtype: torch.dtype
) -> None:
    """For a prefill chunk's rows after its first (their context in cache), the AVX-512 build
    scores 16 tokens at once (their 16 horizontal sums as one tree of shuffles); the AVX2 build
    sums each token's products on its own, in the order both share (vectors.h sum()). Same
    bits, on every shape: full and partial tiles, 8- to 32-token blocks, decode rows, head
    groups past the tiles' register budget."""
    chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim = case
    batch = make_paged_batch(
        chunks, num_decodes, block_size, num_heads, num_kv_heads, head_dim, seed=3
    )
    k_cache, v_cache = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    scale = head_dim**-0.5
    outs = [
        cpu_native.create_backend(build_dir, level).forward(
            batch.query, k_cache, v_cache, batch.meta, scale
        )
        for level in ("avx512", "avx2")
    ]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    ("num_heads", "head_dim", "dtype"),
    [(4, 16, torch.float32), (4, 64, torch.float16), (18, 64, torch.float32)],
    ids=["d16", "fp16", "gqa9"],
)
def test_uncovered_shapes_fall_back_to_the_torch_path(
    backend, monkeypatch: pytest.MonkeyPatch, num_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_paged_batch([(12, 1), (3, 1)], 2, 8, num_heads, 2, head_dim, dtype=dtype, seed=3)
    calls = []
    monkeypatch.setattr(backend, "_decode_fn", lambda *args: calls.append(args) or 0)
    out, expected = forward_and_reference(backend, batch)
    assert calls == []  # the native kernel was not called
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def _strided(cache: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other block of a larger one)."""
    wide = torch.zeros((2 * cache.shape[0], *cache.shape[1:]), dtype=cache.dtype)
    wide[::2] = cache
    return wide[::2]


def test_a_strided_cache_takes_the_torch_path(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_paged_batch([(30, 1), (9, 1)], 2, 8, 4, 2, 64, seed=5)
    expected = forward_and_reference(backend, batch)[1]
    calls = []
    monkeypatch.setattr(backend, "_decode_fn", lambda *args: calls.append(args) or 0)
    k_cache, v_cache = _strided(batch.k_cache), _strided(batch.v_cache)
    out = backend.forward(batch.query, k_cache, v_cache, batch.meta, 64**-0.5)
    assert calls == []
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change", ["value-dtype", "short-table", "block-id-past-pool"])
def test_inputs_the_kernel_cannot_read_safely_never_reach_it(
    backend, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    batch = make_paged_batch([(30, 1), (9, 1)], 2, 8, 4, 2, 64, seed=5)
    v_cache, meta = batch.v_cache, batch.meta
    if change == "value-dtype":
        v_cache = v_cache.to(torch.float64)
    elif change == "short-table":  # narrower than the context: reads would run past the row
        meta.block_tables = meta.block_tables[:, :2].contiguous()
    else:
        meta.block_tables[0, 0] = batch.k_cache.shape[0]
    calls = []
    monkeypatch.setattr(backend, "_decode_fn", lambda *args: calls.append(args) or 0)
    # The torch path may reject these itself; what matters is that no raw pointer is read.
    with contextlib.suppress(RuntimeError, IndexError):
        backend.forward(batch.query, batch.k_cache, v_cache, meta, 0.125)
    assert calls == []


def test_a_new_build_replaces_older_ones_of_its_level(tmp_path: Path) -> None:
    stale = tmp_path / "kernels-native-0123456789abcdef.so"
    legacy = tmp_path / "cpu_kernels-0123456789abcdef.so"  # named before levels were
    other_level = tmp_path / "kernels-avx2-0123456789abcdef.so"
    for path in (stale, legacy, other_level):
        path.write_bytes(b"an older revision")
    native.load_library(tmp_path, "native")
    libraries = sorted(tmp_path.glob("*.so"))
    assert len(libraries) == 2 and other_level in libraries
    assert libraries[1].name.startswith("kernels-native-") and libraries[1] != stale


def test_library_is_built_once_per_source_and_reused(build_dir: Path, backend) -> None:
    level = capabilities.cpu_capabilities().kernel_isa  # the backend fixture's
    libraries = list(build_dir.glob(f"kernels-{level}-*.so"))
    assert len(libraries) == 1
    stamp = libraries[0].stat().st_mtime_ns
    native._load_library.cache_clear()
    native.load_library(build_dir)  # a fresh process would do this: find, not rebuild
    assert libraries[0].stat().st_mtime_ns == stamp
    assert all(p.suffix == ".so" for p in build_dir.iterdir())  # no scratch dir left


@pytest.mark.parametrize(
    ("isa", "march"),
    [
        ("native", "-march=native"),
        ("avx512", "-march=x86-64-v4"),
        ("avx2", "-march=x86-64-v3"),
        ("baseline", "-march=x86-64-v2"),
    ],
)
def test_each_level_builds_for_its_own_target(isa: str, march: str) -> None:
    flags = native.compile_flags(isa)
    assert march in flags and sum(f.startswith("-march=") for f in flags) == 1
    if isa in ("avx2", "baseline"):  # 512-bit vectors are for AVX-512 CPUs only
        assert "-mprefer-vector-width=512" not in flags


def test_kvshare_cpu_isa_forces_the_lowest_level_here(
    build_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lowest = available_isa_levels()[-1]  # baseline on x86-64, native elsewhere
    forced = probe(environ={capabilities.ISA_ENV: lowest})
    assert forced.kernel_isa == lowest and forced.kernel_levels() == (lowest,)
    monkeypatch.setattr(capabilities, "cpu_capabilities", lambda: forced)
    library = native.load_library(build_dir)  # no level given: the probe's
    assert Path(library._name).name.startswith(f"kernels-{lowest}-")


SSE4 = frozenset({"sse4_2", "popcnt", "ssse3", "sse4_1", "cx16", "lahf_lm"})  # x86-64-v2
AVX2 = SSE4 | {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}  # x86-64-v3
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # x86-64-v4

# (cpu flags, KVSHARE_CPU_ISA) -> (isa, kernel_levels), kernel_isa first.
ISA_CASES = {
    "avx512": (AVX512, "", "avx512", ("native", "avx512", "avx2", "baseline")),
    "avx512-without-bw-is-avx2": (AVX2 | {"avx512f"}, "", "avx2", ("native", "avx2", "baseline")),
    "avx512-without-cd-is-avx2": (
        AVX512 - {"avx512cd"},
        "",
        "avx2",
        ("native", "avx2", "baseline"),
    ),
    "avx2-without-bmi2-is-baseline": (AVX2 - {"bmi2"}, "", "baseline", ("native", "baseline")),
    "avx2-without-movbe-is-baseline": (AVX2 - {"movbe"}, "", "baseline", ("native", "baseline")),
    "avx2": (AVX2, "", "avx2", ("native", "avx2", "baseline")),
    "sse4": (SSE4, "", "baseline", ("native", "baseline")),
    "sse4-without-cx16-is-native-only": (SSE4 - {"cx16"}, "", "native", ("native",)),
    "not-x86": (frozenset({"fp", "asimd"}), "", "native", ("native",)),
    "avx512-forced-avx512": (AVX512, "AVX512", "avx512", ("avx512", "avx2", "baseline")),
    "avx512-forced-avx2": (AVX512, "avx2", "avx2", ("avx2", "baseline")),
    "avx2-forced-baseline": (AVX2, " Baseline ", "baseline", ("baseline",)),
    "forced-native": (AVX2, "native", "avx2", ("native", "avx2", "baseline")),
    "forced-above-the-cpu-is-ignored": (SSE4, "avx2", "baseline", ("native", "baseline")),
    "avx2-forced-avx512-is-ignored": (AVX2, "avx512", "avx2", ("native", "avx2", "baseline")),
    "not-x86-forced-is-ignored": (frozenset(), "avx2", "native", ("native",)),
}


@pytest.mark.parametrize("case", ISA_CASES.values(), ids=ISA_CASES.keys())
def test_probe_picks_the_isa_from_cpu_flags_and_env(case: tuple) -> None:
    flags, env_value, isa, levels = case
    found = probe(environ={capabilities.ISA_ENV: env_value}, flags=flags, bf16_supported=False)
    assert (found.isa, found.kernel_levels()) == (isa, levels)
    assert found.kernel_isa == levels[0]


def test_probe_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(capabilities.ISA_ENV, "baseline")
    assert probe(flags=AVX2, bf16_supported=False) == CpuCapabilities("baseline", False, "baseline")


def test_a_failed_build_is_reported_and_auto_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(native.NativeBuildError, match="failed"):
        native.load_library(tmp_path)
    with pytest.raises(ValueError, match="'cpu' is unavailable"):
        get_attention_backend("cpu", CPU, tmp_path)
    with caplog.at_level(logging.WARNING):
        chosen = get_attention_backend("auto", CPU, tmp_path)
    assert type(chosen) is TorchRefBackend
    assert "using the torch attention backend" in caplog.text
    assert list(tmp_path.glob("*.so")) == []


def test_auto_picks_the_native_backend_on_cpu(build_dir: Path) -> None:
    assert get_attention_backend("auto", CPU, build_dir).name == "cpu"
    assert get_attention_backend("cpu", CPU, build_dir).name == "cpu"


def test_cpu_backend_refuses_other_devices(build_dir: Path) -> None:
    with pytest.raises(ValueError, match="runs on the CPU, not 'cuda'"):
        get_attention_backend("cpu", torch.device("cuda"), build_dir)


def test_a_prefill_chunk_runs_in_the_kernel_and_its_rows_do_not_depend_on_its_length(
    backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Query i of a chunk is a decode query at position start + i: its row is the same, bit for
    bit, whether the chunk stops after it or goes on, and equals a decode step's; no chunk the
    kernel covers reaches torch's SDPA."""
    start, new = 100, 24
    batch = make_paged_batch([(start, new)], 0, 16, 9, 3, 64, seed=3)
    table = torch.tensor(batch.block_ids[0])
    scale = 64**-0.5
    torch_prefills = []
    monkeypatch.setattr(
        TorchRefBackend, "_prefill", lambda self, query, *rest: torch_prefills.append(query)
    )
    whole = backend._prefill(batch.query, batch.k_cache, batch.v_cache, table, start + new, scale)
    for length in (1, 7, new):
        part = backend._prefill(
            batch.query[:length], batch.k_cache, batch.v_cache, table, start + length, scale
        )
        assert torch.equal(part, whole[:length])
    first = backend._prefill(batch.query[:5], batch.k_cache, batch.v_cache, table, 5, scale)
    assert first.shape == (5, 9, 64) and torch_prefills == []
    # the chunk's last row as a decode of that one token
    meta = make_metadata([(start + new - 1, 1)], 1, batch.block_ids, [0], "cpu")
    decode = backend.forward(batch.query[-1:], batch.k_cache, batch.v_cache, meta, scale)
    assert torch.equal(decode, whole[-1:])
