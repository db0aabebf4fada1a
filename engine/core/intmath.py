"""Integer arithmetic the layers share (torch-free)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, without floats: e.g. the blocks that hold `a` tokens."""
    return -(-a // b)
