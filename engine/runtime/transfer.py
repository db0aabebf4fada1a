"""Host-to-device copies of the small values a step builds in Python, without stalling.

torch.tensor(values, device="cuda") copies from pageable memory, so the host waits for the
copy before it can queue the next kernel. Staging the values in pinned memory and copying with
non_blocking=True only queues the copy on the stream; torch's pinned-memory allocator keeps
the staging buffer alive until the copy has run. On the CPU the result is the host tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stage(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D host tensor of `values`, pinned when it is bound for a CUDA device."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory() if device.type == "cuda" else host


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, copied without blocking the host."""
    return stage(values, dtype, device).to(device, non_blocking=True)


def split_to_device(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors on `device`, one per list, moved in a single host-to-device copy."""
    flat = to_device([v for part in parts for v in part], torch.int64, device)
    return list(flat.split([len(p) for p in parts]))
