"""PackedLinear (oneDNN, packed weights) against F.linear, the swap of a module tree, and the
bf16 choice between packed and plain linears, which follows the CPU probe.

bf16 packing runs where the probe says this CPU can (AVX-512 or AVX-NE-CONVERT); the plain
bf16 path runs everywhere, forced off on a CPU that could pack, so both are checked here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from engine.core.batch import ScheduledSeq
from engine.core.config import EngineConfig
from engine.runtime.cpu import capabilities
from engine.runtime.cpu.capabilities import BF16_LINEAR_ENV, CpuCapabilities, probe
from engine.runtime.cpu.linear import PackedLinear, can_pack, pack_linears
from engine.runtime.model_runner import ModelRunner
from tests.oracle import random_prompt

CPU = torch.device("cpu")
CAN_PACK_BF16 = capabilities.cpu_capabilities().bf16_linear

# A property of the torch build, not of the CPU: every x86-64 CPU runs oneDNN's fp32 linear.
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN linear"
)

PACKED_DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32")]
if CAN_PACK_BF16:
    PACKED_DTYPES.append(pytest.param(torch.bfloat16, 2e-2, id="bf16"))


@needs_onednn
@pytest.mark.parametrize(("dtype", "tolerance"), PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_f_linear(dtype: torch.dtype, tolerance: float, rows: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    out = PackedLinear(weight, bias)(x)
    assert out.shape == (rows, 48) and out.dtype == dtype
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@needs_onednn
def test_pack_linears_swaps_every_linear_in_the_tree() -> None:
    tree = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 4), nn.ReLU()]))
    x = torch.randn(3, 8)
    before = tree[1][0](tree[0](x))
    assert pack_linears(tree) == 2
    assert isinstance(tree[0], PackedLinear) and isinstance(tree[1][0], PackedLinear)
    assert isinstance(tree[1][1], nn.ReLU)
    torch.testing.assert_close(tree[1][0](tree[0](x)), before, atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bf16_linear", [True, False], ids=["probe-says-bf16", "probe-says-no"])
def test_can_pack_asks_the_probe_for_bf16_only(
    monkeypatch: pytest.MonkeyPatch, bf16_linear: bool
) -> None:
    answer = CpuCapabilities(isa="avx2", bf16_linear=bf16_linear)
    monkeypatch.setattr(capabilities, "cpu_capabilities", lambda: answer)
    assert can_pack(CPU, torch.bfloat16) is bf16_linear
    assert can_pack(CPU, torch.float32)
    assert not can_pack(CPU, torch.float16)
    assert not can_pack(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize(
    ("supported", "env_value", "expected"),
    [
        (True, "", True),
        (True, "1", True),
        (True, "0", False),
        (True, " Off", False),
        (False, "", False),  # an AVX2-only CPU: nothing turns it on
        (False, "1", False),
    ],
)
def test_probe_answers_bf16_linear_from_onednn_and_env(
    supported: bool, env_value: str, expected: bool
) -> None:
    found = probe(environ={BF16_LINEAR_ENV: env_value}, flags=frozenset(), bf16_supported=supported)
    assert found.bf16_linear is expected


# Every bf16 linear path of the model runner: as this CPU's probe answers (packed where
# oneDNN can), and forced off by KVSHARE_CPU_BF16_LINEAR=0 (the path of an AVX2-only CPU).
BF16_PATHS = {
    f"probe-{'packed' if CAN_PACK_BF16 else 'plain'}": capabilities.cpu_capabilities(),
    "forced-off-plain": probe(environ={BF16_LINEAR_ENV: "0"}),
}


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("answer", BF16_PATHS.values(), ids=BF16_PATHS.keys())
def test_bf16_runner_packs_only_where_the_probe_allows_and_tracks_hf(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir, make_step, answer: CpuCapabilities
) -> None:
    monkeypatch.setattr(capabilities, "cpu_capabilities", lambda: answer)
    packed = answer.bf16_linear and torch.backends.mkldnn.is_available()
    assert can_pack(CPU, torch.bfloat16) is packed
    runner = ModelRunner(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="bfloat16", attention_backend="torch",
            block_size=8, num_kv_blocks=32,
        )
    )  # fmt: skip
    kinds = {type(m) for m in runner.model.modules() if isinstance(m, nn.Linear | PackedLinear)}
    assert kinds == ({PackedLinear} if packed else {nn.Linear})
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    ids = random_prompt(20, seed=6)
    sched_out = make_step([ScheduledSeq(0, ids, 0, [0, 1, 2])], 8)
    ours = runner.run_audit(sched_out, {0})[0]  # [V] float32, the last prompt token's logits
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(ours, expected, atol=0.1, rtol=0.05)
    assert ours.argmax() == expected.argmax()
