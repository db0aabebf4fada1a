"""Choosing the attention backend from the `attention_backend` setting."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.attention import select
from engine.runtime.attention.select import get_attention_backend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only named, never touched: choosing does not need a GPU


@pytest.fixture
def no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "is_triton_available", lambda: False)


def test_unknown_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="one of"):
        get_attention_backend("flash", CPU)


@pytest.mark.parametrize(("name", "device"), [("torch", CPU), ("torch", CUDA)])
def test_torch_reference_where_asked(name: str, device: torch.device) -> None:
    pytest.importorskip("engine.runtime.attention.torch_ref")
    assert get_attention_backend(name, device).name == "torch"


@pytest.mark.usefixtures("without_triton")
def test_auto_falls_back_to_torch_on_cuda_without_triton() -> None:
    pytest.importorskip("engine.runtime.attention.torch_ref")
    assert get_attention_backend("auto", CUDA).name == "torch"


@pytest.mark.usefixtures("without_triton")
def test_triton_without_the_package_says_how_to_install() -> None:
    with pytest.raises(ValueError, match=r"pip install 'kvshare\[triton\]'"):
        get_attention_backend("triton", CUDA)


@pytest.mark.usefixtures("no_interpreter")
def test_triton_on_cpu_without_interpreter_is_rejected() -> None:
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="runs on CUDA devices, not 'cpu'"):
        get_attention_backend("triton", CPU)


@pytest.mark.parametrize(("name", "device"), [("auto", CUDA), ("triton", CUDA)])
def test_triton_on_cuda(name: str, device: torch.device) -> None:
    pytest.importorskip("triton")
    assert get_attention_backend(name, device).name == "triton"


def test_triton_on_cpu_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention_backend("triton", CPU).name == "triton"
