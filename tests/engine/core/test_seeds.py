"""engine/core/seeds.py: splitmix64 against its published outputs, and the seeds built on it."""

from __future__ import annotations

import pytest

from engine.core.intmath import cdiv
from engine.core.seeds import GOLDEN_GAMMA, MAX_SEED, derive_seed, draw_key, mix64, random_seed


def test_mix64_gives_splitmix64s_published_outputs_from_state_0() -> None:
    outputs = [mix64(i * GOLDEN_GAMMA) for i in (1, 2, 3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_choice_0_keeps_the_request_seed_and_the_others_are_splitmix_outputs() -> None:
    assert derive_seed(7, 0) == 7
    assert derive_seed(0, 1) == 0xE220A8397B1DCDAF & MAX_SEED
    seeds = [derive_seed(MAX_SEED, i) for i in range(1, 200)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s <= MAX_SEED for s in seeds)


def test_draw_keys_differ_per_seed_and_per_output_index() -> None:
    keys = {draw_key(seed, t) for seed in (0, 1, MAX_SEED) for t in range(50)}
    assert len(keys) == 150
    assert draw_key(5, 3) == mix64(mix64(5) + 4 * GOLDEN_GAMMA)


def test_random_seeds_are_in_range() -> None:
    assert all(0 <= random_seed() <= MAX_SEED for _ in range(100))


@pytest.mark.parametrize(
    ("a", "b", "expected"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 8, 5)]
)
def test_cdiv_is_ceiling_division(a: int, b: int, expected: int) -> None:
    assert cdiv(a, b) == expected
