"""Small host-to-device copies: values, dtypes and splits survive the trip."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.transfer import split_to_device, to_device

DEVICES = [
    torch.device("cpu"),
    pytest.param(torch.device("cuda"), marks=pytest.mark.gpu),  # skipped without CUDA
]


@pytest.mark.parametrize("device", DEVICES)
def test_values_and_dtype_arrive(device: torch.device) -> None:
    floats = to_device([0.5, -2.0, 3.25], torch.bfloat16, device)
    assert floats.device.type == device.type and floats.dtype == torch.bfloat16
    assert floats.cpu().tolist() == [0.5, -2.0, 3.25]
    assert to_device([], torch.int64, device).shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_split_keeps_each_list_and_its_length(device: torch.device) -> None:
    parts = [[1, 2, 3], [], [2**40], [7, 8]]
    tensors = split_to_device(parts, device)
    assert [t.cpu().tolist() for t in tensors] == parts
    assert {t.dtype for t in tensors} == {torch.int64}
