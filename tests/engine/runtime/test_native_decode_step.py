"""The native decode step (engine/runtime/cpu/decode_step.cpp) against the torch model it
replaces: the same block-quantized tiny model (Llama; Qwen3 with its q/k norms; Gemma 3 with its
four norms a layer, GELU-tanh, sliding windows of 8 positions and two rope tables), module by
module through the fused ops, is the reference; the native step must give the same hidden rows
and write the same KV, bit for bit, and decline every step or model it does not compute
exactly."""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from engine.core.batch import ScheduledSeq
from engine.core.config import EngineConfig
from engine.runtime.attention import cpu_native
from engine.runtime.cpu import quant
from engine.runtime.cpu.block_linear import (
    BlockLinear,
    BlockLinearParts,
    BlockWeight,
    quantize_q8_0,
)
from engine.runtime.cpu.capabilities import available_isa_levels
from engine.runtime.cpu.decode_step import NativeDecodeStep
from engine.runtime.cpu.fused import CpuFusedOps
from engine.runtime.cpu.native import INTERFACE, load_library
from engine.runtime.loader import load_model
from engine.runtime.step_inputs import prepare_inputs
from tests.oracle import random_prompt

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler"),
    pytest.mark.usefixtures("single_thread"),
]
CPU = torch.device("cpu")
BLOCK_SIZE = 8
# The layers the step computes: Llama's, and Gemma 3's (q/k norms, four norms, GELU-tanh, its
# window of 8 positions crossed by every test's longer sequences, two rope tables), here with
# its q/k/v rows in two formats (BlockLinearParts) as the real GGUF has 9 of its 18 layers;
# Qwen3's (Llama's with q/k norms), Gemma's with one fused q/k/v and with three runs of two
# formats in the wanted-rows test.
# Gemma's in fewer combinations: its head (tied) and thread split (2 threads) as served.
FAMILY_TIED = [("llama", False), ("llama", True), ("gemma3-mixed", True)]
FAMILY_THREADS = [("llama", False), ("llama", True), ("gemma3-mixed", True)]


def family_model(library, make_tiny_model, family: str, **overrides):
    arch, _, variant = family.partition("-")
    directory = make_tiny_model(arch, head_dim=64, **overrides)
    model = block_model(library, directory, mixed_qkv=variant)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, BlockLinearParts if variant else BlockLinear)
    assert len(getattr(qkv, "parts", [qkv])) == {"": 1, "mixed": 2, "mixed3": 3}[variant]
    return model


@pytest.fixture(scope="module", params=available_isa_levels())
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return load_library(tmp_path_factory.getbasetemp() / "native-kernels", request.param)


def block_model(library, model_dir, mixed_qkv: str = ""):
    """The tiny model with Q8_0 projections and head, through the fused ops (no native step).
    mixed_qkv "mixed": each layer's q and k rows in Q8_0 and its v rows in Q5_0
    (BlockLinearParts, two runs), as the real Gemma 3 GGUF stores 9 of its 18 layers; "mixed3":
    q in Q8_0, k in Q5_0, v in Q8_0 (three runs)."""
    model = load_model(EngineConfig(model=str(model_dir)), CPU, torch.float32).model
    blocks = quant._q8_0_blocks(model)
    if mixed_qkv:
        spec = model.spec
        kv_rows = spec.num_kv_heads * spec.head_dim
        q_rows = spec.num_heads * spec.head_dim
        for i, layer in enumerate(model.model.layers):
            weight = layer.self_attn.qkv_proj.weight.detach()
            q, k, v = weight[:q_rows], weight[q_rows:-kv_rows], weight[-kv_rows:]
            parts = (
                (quantize_q8_0(weight[:-kv_rows]), _q5_0(v))
                if mixed_qkv == "mixed"
                else (quantize_q8_0(q), _q5_0(k), quantize_q8_0(v))
            )
            blocks[f"model.layers.{i}.self_attn.qkv_proj"] = parts
    quant._replace_with_blocks(model, blocks, library)
    model.use_fused_ops(CpuFusedOps(library))
    return model


def _q5_0(weight: torch.Tensor) -> BlockWeight:
    rows = np.ascontiguousarray(weight.numpy())
    data = torch.from_numpy(quantize(rows, GGMLQuantizationType.Q5_0))
    return BlockWeight("Q5_0", data, rows.shape[1])


def caches(model, num_blocks: int = 16, dtype: torch.dtype = torch.float32, block_size=BLOCK_SIZE):
    spec = model.spec
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    generator = torch.Generator().manual_seed(7)  # stale contents: never read past seq_lens
    return [
        tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
        for _ in range(spec.num_layers)
    ]


def run(
    model,
    backend,
    kv,
    make_step,
    seqs,
    num_decodes=0,
    output_rows=None,
    block_size=BLOCK_SIZE,
    tile_prompts=False,
) -> torch.Tensor:
    inputs = prepare_inputs(make_step(seqs, block_size, num_decodes), CPU, tile_prompts)
    rows = None if output_rows is None else torch.tensor(output_rows, dtype=torch.int64)
    with torch.inference_mode():
        hidden = model(
            inputs.input_ids, inputs.positions, inputs.meta, kv, backend, output_rows=rows
        )
        return hidden.clone()  # the native step returns a reused buffer


def mixed_steps() -> list[tuple[list[ScheduledSeq], int]]:
    """(seqs, num_decodes) of three steps: a first chunk; its continuation beside a new prompt;
    a decode, a continuation chunk crossing a block and a new prompt. Prompt lengths 22, 9 and
    30: the last step's rows are a generated token, a prompt token, two generated tokens (a
    recomputed answer) and a prompt (tile_rows 0, 1, 0, 0, then 1s)."""
    a, b, c = (random_prompt(n, seed=n) for n in (21, 9, 30))
    return [
        ([ScheduledSeq(0, a[:11], 0, [0, 1, 2], prompt_len=22)], 0),
        (
            [
                ScheduledSeq(0, a[11:21], 11, [0, 1, 2], prompt_len=22),
                ScheduledSeq(1, b, 0, [3, 4], prompt_len=9),
            ],
            0,
        ),
        (
            [
                ScheduledSeq(1, [7], 9, [3, 4], prompt_len=9),
                ScheduledSeq(0, [5, 6, 8], 21, [0, 1, 2], prompt_len=22),
                ScheduledSeq(2, c, 0, [5, 6, 7, 8], prompt_len=30),
            ],
            1,
        ),
    ]


@pytest.mark.parametrize(
    ("family", "tied"), FAMILY_TIED, ids=["llama-untied", "llama-tied", "gemma3-mixed-tied"]
)
@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16], ids=["block-8", "block-16"])
def test_decode_steps_are_bit_identical_to_the_torch_model(
    library, make_tiny_model, make_step, family, tied, num_rows, block_size
) -> None:
    """From the second layer on, the native step asks for a layer's K/V during the MLP before
    and then scores decode rows in 16-token tiles (paged_attention.cpp, on AVX-512 with 16-token
    blocks); the torch model's attention scores them token by token: the same bits."""
    model = family_model(library, make_tiny_model, family, tie_word_embeddings=tied)
    step = NativeDecodeStep.for_model(model, library)
    assert step is not None
    backend = cpu_native.CpuNativeBackend(library)
    prompts = [random_prompt(5 + i, seed=10 + i) for i in range(num_rows)]
    tables = [[2 * i, 2 * i + 1] for i in range(num_rows)]
    reference_kv = caches(model, block_size=block_size)
    native_kv = caches(model, block_size=block_size)
    prefill = [ScheduledSeq(i, p, 0, tables[i]) for i, p in enumerate(prompts)]
    for kv in (reference_kv, native_kv):  # both through the torch path
        run(model, backend, kv, make_step, prefill, block_size=block_size)
    tokens = [len(p) for p in prompts]
    for offset in range(3):  # three decode steps, the same tokens fed to both
        seqs = [
            ScheduledSeq(i, [(17 * i + offset) % 250 + 3], tokens[i] + offset, tables[i])
            for i in range(num_rows)
        ]
        model.use_native_decode(None)
        expected = run(model, backend, reference_kv, make_step, seqs, num_rows, None, block_size)
        model.use_native_decode(step)
        got = run(model, backend, native_kv, make_step, seqs, num_rows, None, block_size)
        assert torch.equal(got, expected)
    assert step.steps_run == 3
    for (k_ref, v_ref), (k_got, v_got) in zip(reference_kv, native_kv, strict=True):
        assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
    logits = model.compute_logits(got)
    reference_logits = F.linear(expected, _head_weight(model))
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-4)


def _head_weight(model) -> torch.Tensor:
    return model.lm_head.block_weight.dequantize()


@pytest.mark.parametrize(
    ("family", "two_threads"),
    FAMILY_THREADS,
    ids=["llama-1-thread", "llama-2-threads", "gemma3-mixed-2-threads"],
)
@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("tile_prompts", [False, True], ids=["fmas", "prompts-on-tiles"])
def test_prefill_and_mixed_steps_are_bit_identical_to_the_torch_model(
    library, make_tiny_model, make_step, family, two_threads, cache_dtype, tile_prompts
) -> None:
    """First chunks, continuation chunks and decodes in one step: every token is a decode
    query at its own position, in the native stack as in the module path's attention; over
    each KV cache dtype (kv_cache_dtype), K/V rounded alike where they are stored; with the
    prompt tokens' projections on their path (AMX tiles where this build and CPU have them,
    else the prefill GEMM) and the generated tokens' on the FMAs, in runs of either kind
    (tile_rows)."""
    model = family_model(library, make_tiny_model, family)
    step = NativeDecodeStep.for_model(model, library)
    backend = cpu_native.CpuNativeBackend(library)
    steps = mixed_steps()
    reference_kv, native_kv = caches(model, dtype=cache_dtype), caches(model, dtype=cache_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if two_threads else 1)
    try:
        for seqs, num_decodes in steps:
            model.use_native_decode(None)
            expected = run(
                model, backend, reference_kv, make_step, seqs, num_decodes,
                tile_prompts=tile_prompts,
            )  # fmt: skip
            model.use_native_decode(step)
            got = run(
                model, backend, native_kv, make_step, seqs, num_decodes, tile_prompts=tile_prompts
            )
            assert torch.equal(got, expected)
    finally:
        torch.set_num_threads(threads)
    assert step.steps_run == len(steps)
    for (k_ref, v_ref), (k_got, v_got) in zip(reference_kv, native_kv, strict=True):
        assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_models_it_does_not_compute_exactly_are_declined(library, make_tiny_model) -> None:
    exact = load_model(
        EngineConfig(model=str(make_tiny_model("llama", head_dim=64))), CPU, torch.float32
    ).model
    assert NativeDecodeStep.for_model(exact, library) is None  # fp32 nn.Linear projections
    small_heads = block_model(library, make_tiny_model("llama"))  # head_dim 16
    assert NativeDecodeStep.for_model(small_heads, library) is None
    biased = block_model(library, make_tiny_model("qwen2", head_dim=64))  # q/k/v biases
    assert NativeDecodeStep.for_model(biased, library) is None
    gemma = block_model(library, make_tiny_model("gemma3", head_dim=64))
    assert NativeDecodeStep.for_model(gemma, library) is not None
    gemma.model.layers[1].self_attn.scale = 0.5  # one scale a model, as the kernel takes it
    assert NativeDecodeStep.for_model(gemma, library) is None


def test_a_float64_cache_is_declined_untouched(library, make_tiny_model, make_step) -> None:
    model = block_model(library, make_tiny_model("llama", head_dim=64))
    step = NativeDecodeStep.for_model(model, library)
    spec = model.spec
    shape = (16, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    kv = [(torch.zeros(shape, dtype=torch.float64),) * 2 for _ in range(spec.num_layers)]
    inputs = prepare_inputs(make_step([ScheduledSeq(0, [5], 3, [0])], BLOCK_SIZE, 1), CPU)
    hidden = model.model.embed_tokens(inputs.input_ids)
    before = hidden.clone()
    assert step.run(hidden, inputs.positions, inputs.meta, kv) is None
    assert torch.equal(hidden, before)


@pytest.mark.parametrize(
    "wanted",
    [lambda lasts: lasts, lambda lasts: [], lambda lasts: [0, *lasts[1:]]],
    ids=["last-rows", "none", "first-and-lasts"],
)
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma3-mixed3"])
def test_a_steps_wanted_rows_alone_are_the_rows_of_the_whole_step(
    library, make_tiny_model, make_step, wanted, family
) -> None:
    """output_rows: the last layer runs past its K/V store on the wanted rows only (a prefill
    chunk's other rows need their K/V and nothing else). Those rows must be the whole step's,
    bit for bit, and every row's K/V must still be stored as the torch model stores it."""
    model = family_model(library, make_tiny_model, family)
    step = NativeDecodeStep.for_model(model, library)
    backend = cpu_native.CpuNativeBackend(library)
    steps = mixed_steps()
    reference_kv, native_kv = caches(model), caches(model)
    for seqs, num_decodes in steps:
        lasts = list(itertools.accumulate(len(seq.token_ids) for seq in seqs))
        rows = wanted([last - 1 for last in lasts])
        model.use_native_decode(None)
        expected = run(
            model, backend, reference_kv, make_step, seqs, num_decodes, tile_prompts=True
        )
        model.use_native_decode(step)
        got = run(
            model, backend, native_kv, make_step, seqs, num_decodes, output_rows=rows,
            tile_prompts=True,
        )  # fmt: skip
        assert got.shape == (len(rows), expected.shape[1])
        assert torch.equal(got, expected[rows])
    assert step.steps_run == len(steps)
    for (k_ref, v_ref), (k_got, v_got) in zip(reference_kv, native_kv, strict=True):
        assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_wanted_rows_out_of_order_are_refused(library, make_tiny_model, make_step) -> None:
    model = block_model(library, make_tiny_model("llama", head_dim=64))
    model.use_native_decode(NativeDecodeStep.for_model(model, library))
    backend = cpu_native.CpuNativeBackend(library)
    seqs = [ScheduledSeq(0, random_prompt(6, seed=1), 0, [0])]
    with pytest.raises(RuntimeError, match="status 3"):
        run(model, backend, caches(model), make_step, seqs, output_rows=[4, 2])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
def test_the_kernels_share_torchs_openmp_runtime(library) -> None:
    """One thread pool: the library resolves libgomp.so.1 to the copy torch loaded, so its
    parallel regions and torch's never run two pools of threads against each other."""
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line and "r-xp" in line}
    assert len(runtimes) == 1, runtimes


def test_prompt_rows_take_their_path_on_every_build(
    make_tiny_model, make_step, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tile_rows reaches the kernels: a prompt chunk's rows change bits with it exactly where
    the projections' prompt path is not the FMAs (kvshare_prompt_path: AMX tiles where the
    build and the CPU have them, the prefill GEMM, or the panels' FMAs on AVX-512 builds),
    within the F.linear bound the other tests hold."""
    seqs = [ScheduledSeq(0, random_prompt(20, seed=3), 0, [0, 1, 2], prompt_len=20)]
    for level in available_isa_levels():
        library = load_library(tmp_path_factory.getbasetemp() / "native-kernels", level)
        model = block_model(library, make_tiny_model("llama", head_dim=64))
        model.use_native_decode(NativeDecodeStep.for_model(model, library))
        backend = cpu_native.CpuNativeBackend(library)
        fmas, tiles = (
            run(model, backend, caches(model), make_step, seqs, tile_prompts=on)
            for on in (False, True)
        )
        torch.testing.assert_close(tiles, fmas, atol=1e-3, rtol=1e-3)
        codes = {m.block_weight.code for m in model.modules() if isinstance(m, BlockLinear)}
        paths = {library.kvshare_prompt_path(code) for code in codes}
        assert torch.equal(tiles, fmas) == (paths == {INTERFACE.constants["kPromptFmas"]}), level
