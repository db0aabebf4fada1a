"""GreedyHead (engine/runtime/cpu/greedy_head.cpp): each row's greedy token under a
Q8_0 panel head from estimated logits and the few panels that can hold the largest, against
torch.argmax of the full head's logits (BlockLinear, itself tested against F.linear on the
dequantized weights), on every kernel build level this CPU runs: the VNNI estimate where the
build and the CPU have it, the plain loops elsewhere."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.runtime.cpu.block_linear import BlockLinear, BlockWeight, GreedyHead, to_panels
from engine.runtime.cpu.capabilities import available_isa_levels, cpu_flags
from engine.runtime.cpu.native import load_library
from engine.runtime.cpu.quant import greedy_head
from tests.engine.runtime.kernel_paths import kernel_path, kernel_paths
from tests.engine.runtime.test_block_linear import randn, random_blocks

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")

VNNI_FLAGS = frozenset({"avx512_vnni", "avx512vbmi"})


@pytest.fixture(scope="module", params=kernel_paths())
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    # The session's build dir, shared with the other native kernel tests: one build per level.
    with kernel_path(tmp_path_factory.getbasetemp() / "native-kernels", request.param) as library:
        yield library


def q8_0_head(library, out_features: int, in_features: int, seed: int) -> BlockLinear:
    return BlockLinear(
        to_panels(random_blocks("Q8_0", out_features, in_features, seed)), None, library
    )


def full_argmax(head: BlockLinear, x: torch.Tensor) -> torch.Tensor:
    return head(x).argmax(dim=-1)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 65])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (400, 96), (2048, 576)])
def test_greedy_tokens_are_the_argmax_of_the_full_heads_logits(
    library, rows: int, out_features: int, in_features: int
) -> None:
    head = q8_0_head(library, out_features, in_features, seed=rows)
    greedy = GreedyHead(head, library)
    for seed in range(4):
        x = randn(rows, in_features, seed=seed)
        x[:, seed % in_features] *= 40  # an outlier channel, as final hidden states have
        assert torch.equal(greedy(x), full_argmax(head, x))
        if out_features == 2048:  # the estimate narrowed it: a few of 128 panels a row
            assert greedy.panels_computed <= 16 * rows


def test_head_rows_the_estimate_ranks_the_wrong_way_are_ranked_exactly(library) -> None:
    """Pairs of head rows a few codes apart (+1 on weights 37 and 38, -1 on 39), at inputs that
    the int8 codes round the wrong way (0.45 and 0.45 of a quantization step down to 0, 0.55 up
    to 1): the estimate puts the first row of each pair ahead, the exact logits the second."""
    blocks = random_blocks("Q8_0", 512, 64, seed=5)
    data = blocks.data.clone().view(512, 2, 34)
    codes = data[:, :, 2:].view(torch.int8)
    codes.clamp_(-100, 100)  # room for the changes below
    scales = data[:, :, 0:2].view(torch.float16)
    pairs = [(7, 300), (40, 41), (129, 130), (2, 500)]  # other panels and the same panel
    for first, second in pairs:
        scales[first, 1] = 0.05  # positive and large: the changes move the logits visibly
        data[second] = data[first]
        codes[second, 1, 5:7] += 1
        codes[second, 1, 7] -= 1
    head = BlockLinear(to_panels(BlockWeight("Q8_0", data.view(512, 68), 64)), None, library)
    x = head.block_weight.dequantize()[[first for first, _ in pairs]].clone()
    x[:, 33] = 2 * x[:, 32:64].abs().amax(dim=1)  # the group's largest: its step is x_33 / 127
    step = x[:, 33] / 127
    x[:, 37], x[:, 38], x[:, 39] = 0.45 * step, 0.45 * step, 0.55 * step
    expected = full_argmax(head, x)
    assert expected.tolist() == [second for _, second in pairs]
    assert torch.equal(GreedyHead(head, library)(x), expected)


def test_ties_go_to_the_first_index_as_torch_argmax(library) -> None:
    """Byte-identical head rows give bit-identical logits; the first of them must win, also when
    the copies sit in other panels."""
    blocks = random_blocks("Q8_0", 256, 64, seed=3)
    x = randn(3, 64, seed=4)
    x[1] = x[0] * 2.0  # the same argmax
    winner = int(full_argmax(BlockLinear(to_panels(blocks), None, library), x[:1]))
    data = blocks.data.clone()
    first = (winner + 100) % 256  # the copies: one in another panel, and others around
    copies = sorted({first, (winner + 1) % 256, (winner + 16) % 256, (winner + 200) % 256})
    for row in copies:
        data[row] = data[winner]
    head = BlockLinear(to_panels(BlockWeight("Q8_0", data, 64)), None, library)
    tied = sorted({winner, *copies})
    logits = head(x)
    assert (logits[:2, tied] == logits[:2, tied[:1]]).all()
    expected = full_argmax(head, x)
    assert expected[:2].tolist() == [tied[0], tied[0]]
    assert torch.equal(GreedyHead(head, library)(x), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_that_is_not_finite_is_left_to_the_full_head(library, bad: float) -> None:
    head = q8_0_head(library, 64, 64, seed=1)
    x = randn(3, 64, seed=2)
    x[1, 10] = bad
    assert GreedyHead(head, library)(x) is None
    assert GreedyHead(head, library)(x[::2]) is not None  # the finite rows alone are answered


def test_a_head_with_a_bias_or_rows_that_are_not_finite_is_refused(library) -> None:
    blocks = random_blocks("Q8_0", 64, 64, seed=6)
    biased = BlockLinear(to_panels(blocks), torch.zeros(64), library)
    data = blocks.data.clone()
    data[9, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # an fp16 scale of +inf
    infinite = BlockLinear(to_panels(BlockWeight("Q8_0", data, 64)), None, library)
    for head, why in ((biased, "without a bias"), (infinite, "rows are finite")):
        with pytest.raises(ValueError, match=why):
            GreedyHead(head, library)
        assert greedy_head(head, library) is None


def test_the_row_norms_bound_the_heads_rows(library) -> None:
    head = q8_0_head(library, 160, 96, seed=4)
    norms = GreedyHead(head, library).norms
    exact = head.block_weight.dequantize().double().norm(dim=1)
    assert (norms.double() >= exact).all()
    assert (norms.double() <= exact * (1 + 1e-5)).all()


def test_only_a_q8_0_panel_head_is_taken(library) -> None:
    q4 = BlockLinear(to_panels(random_blocks("Q4_1", 64, 64, seed=1)), None, library)
    rows_layout = BlockLinear(random_blocks("Q8_0", 64, 64, seed=1), None, library)
    for head in (q4, rows_layout):
        assert greedy_head(head, library) is None
        with pytest.raises(ValueError, match="Q8_0"):
            GreedyHead(head, library)


def test_the_estimate_runs_on_vnni_exactly_where_the_build_and_the_cpu_have_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The fast path (and so the product's use of GreedyHead) on a CPU with AVX-512 VNNI and VBMI,
    in the AVX-512 builds: -march=native, and the portable x86-64-v4 one (the runtime image's),
    which compiles the estimate alone for them and asks the CPU. Never in the levels below."""
    for level in available_isa_levels():
        library = load_library(tmp_path_factory.getbasetemp() / "native-kernels", level)
        fast = level in ("native", "avx512") and cpu_flags() >= VNNI_FLAGS
        assert bool(library.kvshare_greedy_head_fast()) == fast, level
        head = q8_0_head(library, 64, 64, seed=2)
        assert (greedy_head(head, library) is not None) == fast, level
