"""Shared fixtures: tiny random HF checkpoints saved to disk, and a paged-batch builder; and
the one place that skips `gpu`-marked tests without a CUDA device.

torch and transformers are imported inside the fixtures (and the hook) so that test modules
which never touch a model (app/, engine core) do not pay for them.

GPU tests: mark them `pytestmark = pytest.mark.gpu` (or mark the test or param); the hook
below skips them when CUDA is absent. A module skips itself at import time only where an
import would fail there; one that needs compiled Triton adds the `compiled_triton` fixture
and imports triton code inside its tests, never while it is collected.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import build_tiny_hf_model


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """make_tiny_model(arch="llama", seed=0, **config_overrides) -> saved HF directory.

    Session-cached by arguments; the same arguments always give the same weights.
    """
    saved: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in saved:
            model = build_tiny_hf_model(arch, seed, **overrides)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            saved[key] = path
        return saved[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model) -> Path:
    """The default tiny Llama (untied embeddings, GQA 4/2, vocab 256, 256 positions)."""
    return make_tiny_model()


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV slots of positions start..end-1 for a sequence with this block table."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


@pytest.fixture
def make_step() -> Callable[..., Any]:
    """make_step(seqs, block_size, num_decodes=0) -> SchedulerOutput with its slot_mapping."""
    from engine.core.batch import SchedulerOutput

    def make(seqs, block_size: int, num_decodes: int = 0, block_copies=None):
        slot_mapping = [
            slot
            for seq in seqs
            for slot in slots_for(seq.block_ids, seq.start_pos, seq.context_len, block_size)
        ]
        return SchedulerOutput(
            seqs=list(seqs),
            slot_mapping=slot_mapping,
            block_copies=list(block_copies or []),
            num_decodes=num_decodes,
        )

    return make


@pytest.fixture
def single_thread():
    """Run a test on one torch thread (restored after): tiny shapes gain nothing from more,
    and on a busy machine OpenMP threads spinning against each other cost seconds per test."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- GPU tests ---------------------------------------------------------------------------------
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every `gpu`-marked test when torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or _cuda_is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker, tests/conftest.py)")
    for item in gpu_items:
        item.add_marker(skip)


def _cuda_is_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def compiled_triton() -> None:
    """Skip unless Triton compiles kernels here: triton installed, TRITON_INTERPRET unset.

    A fixture, not a module-level check, because importing triton while tests are collected
    leaves it loaded outside the interpreter, and test_triton_kernels.py would then have to
    run in a fresh process.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: kernels would not be compiled")
    pytest.importorskip("triton")
