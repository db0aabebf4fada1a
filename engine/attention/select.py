"""Pick the attention backend from the `attention_backend` setting: auto | torch | triton.

Backends are imported lazily: the torch reference never pulls in Triton, and Triton is only
imported when it is chosen (or probed for "auto" on CUDA).
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: triton on CUDA when Triton is installed, torch otherwise.

    Raises ValueError for an unknown name, or for "triton" where it cannot run: Triton is not
    installed, or the device is not CUDA and TRITON_INTERPRET=1 is not set.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and is_triton_available() else "torch"
    if name == "torch":
        from engine.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    _check_triton_can_run(device)
    from engine.attention.triton_backend import TritonBackend

    return TritonBackend()


def is_triton_available() -> bool:
    """Whether `import triton` works (a broken install counts as unavailable)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_triton_can_run(device: torch.device) -> None:
    if not is_triton_available():
        raise ValueError(
            "attention backend 'triton' needs the triton package: pip install 'kvshare[triton]'"
        )
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpreting:
        raise ValueError(
            f"attention backend 'triton' runs on CUDA devices, not {device.type!r} "
            "(on the CPU use 'torch', or set TRITON_INTERPRET=1 to run the kernels slowly)"
        )
