"""Pick the attention backend from the `attention_backend` setting: auto | torch | cpu | triton.

Backends are imported lazily: the torch reference never pulls in Triton, and Triton is only
imported when it is chosen (or probed for "auto" on CUDA). "cpu" is the torch reference with
its decode attention in a native kernel (engine/runtime/attention/cpu_native.py), compiled on
first use by engine/runtime/cpu/native.py.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from engine.core.config import ATTENTION_BACKENDS, EngineConfig
from engine.runtime.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


def get_attention_backend(
    name: str, device: torch.device, build_dir: Path | None = None
) -> AttentionBackend:
    """auto: triton on CUDA when Triton is installed; on the CPU, cpu when its kernel builds
    (logged fallback to torch when it does not); torch otherwise.

    build_dir is where the cpu backend's kernel library is compiled and cached (default:
    kernels/ in the kvshare cache dir). Raises ValueError for an unknown name, for "cpu" off
    the CPU or when its kernel cannot be built, or for "triton" where it cannot run: Triton is not
    installed, or the device is not CUDA and TRITON_INTERPRET=1 is not set.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if build_dir is None:
        build_dir = EngineConfig().cache_root() / "kernels"
    if name == "auto" and device.type == "cpu":
        return _cpu_or_torch(build_dir)
    if name == "auto":
        name = "triton" if device.type == "cuda" and is_triton_available() else "torch"
    if name == "torch":
        from engine.runtime.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "cpu":
        return _cpu_backend(device, build_dir)
    _check_triton_can_run(device)
    from engine.runtime.attention.triton_backend import TritonBackend

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
            "(on the CPU use 'cpu' or 'torch', or set TRITON_INTERPRET=1 to run the kernels slowly)"
        )


def _cpu_backend(device: torch.device, build_dir: Path) -> AttentionBackend:
    from engine.runtime.attention import cpu_native
    from engine.runtime.cpu.native import NativeBuildError

    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU, not {device.type!r}")
    try:
        return cpu_native.create_backend(build_dir)
    except NativeBuildError as exc:
        raise ValueError(f"attention backend 'cpu' is unavailable: {exc}") from exc


def _cpu_or_torch(build_dir: Path) -> AttentionBackend:
    try:
        return _cpu_backend(torch.device("cpu"), build_dir)
    except ValueError as exc:
        from engine.runtime.attention.torch_ref import TorchRefBackend

        logger.warning("%s; using the torch attention backend", exc)
        return TorchRefBackend()
