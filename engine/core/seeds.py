"""Seeds and counter-based random keys (torch-free): splitmix64 on python ints.

Invariant 4 (the README): a draw is a pure function of (seed, t). This module is the one
definition of the seed range and of the mixing function; engine/runtime/sampler.py runs the
same finaliser on int64 tensors, and a test compares it against mix64() here.
"""

from __future__ import annotations

import secrets

MAX_SEED = 2**63 - 1  # seeds are non-negative int64 values
MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd
MIX1 = 0xBF58476D1CE4E5B9  # splitmix64's finaliser multipliers
MIX2 = 0x94D049BB133111EB


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit values that scatters every input bit."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, output_index: int) -> int:
    """The 64-bit key of the draw for output token `output_index` of a row seeded `seed`."""
    return mix64(mix64(seed) + (output_index + 1) * GOLDEN_GAMMA)


def derive_seed(seed: int, index: int) -> int:
    """Seed of choice `index` of a request seeded with `seed` (a pure function).

    Choice 0 keeps the request seed, so n=1 and choice 0 of n>1 draw the same tokens; choice
    i > 0 takes splitmix64's i-th output from the state `seed`.
    """
    if index == 0:
        return seed
    return mix64(seed + index * GOLDEN_GAMMA) & MAX_SEED


def random_seed() -> int:
    """A fresh seed for a request that brought none."""
    return secrets.randbelow(MAX_SEED + 1)
