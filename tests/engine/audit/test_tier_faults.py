"""Tier drills (engine/audit/tier_faults.py) on the tiny random Llama with the disk tier: every
injected fault is detected on load (counted as a checksum failure or a refused entry), nothing
damaged is served (greedy outputs equal the cache-off engine's), and a clean run raises no
alarm."""

from __future__ import annotations

import random

import pytest

from engine.core.protocol import EngineRequest
from engine.llm_engine import LLMEngine
from tests.engine.engine_helpers import GREEDY, VOCAB, make_engine

PROMPTS = [[random.Random(seed).randrange(3, VOCAB) for _ in range(100)] for seed in range(4)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    return [result.token_ids[0] for result in engine.generate(PROMPTS, GREEDY)]


def serve_all(engine: LLMEngine, round_id: str) -> list[list[int]]:
    """Each prompt alone, in order; their greedy tokens."""
    outputs = []
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"{round_id}-{index}", prompt, GREEDY))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.error is None, output.error
                tokens += output.outputs[0].new_token_ids
        outputs.append(tokens)
    assert engine.stats().num_leaked_blocks == 0
    return outputs


def tiered(model_dir: str, directory) -> LLMEngine:
    # 16 blocks of 16 tokens: each round pushes every prompt's blocks through the tier.
    return make_engine(
        model_dir,
        num_kv_blocks=16,
        kv_tier="disk",
        kv_tier_dir=str(directory),
        enable_fault_injection=True,
    )


def alarms(engine: LLMEngine) -> int:
    stats = engine.stats()
    return stats.num_tier_checksum_failures + stats.num_tier_refused_entries


@pytest.mark.parametrize(
    "kind", ["tier_bit_flip", "tier_truncate", "tier_foreign_namespace", "tier_foreign_model"]
)
def test_an_injected_tier_fault_is_detected_and_never_served(
    tiny_model_dir, reference, tmp_path, kind
) -> None:
    engine = tiered(tiny_model_dir, tmp_path)
    assert serve_all(engine, "fill") == reference
    report = engine.inject_fault(kind)
    assert report.kind == kind and "tier entry" in report.detail
    assert serve_all(engine, "after") == reference
    assert engine.stats().prefix_cache_tier_hits > 0
    assert alarms(engine) == 1
    engine.close()


def test_a_clean_run_raises_no_alarm(tiny_model_dir, reference, tmp_path) -> None:
    engine = tiered(tiny_model_dir, tmp_path)
    for round_id in ("one", "two", "three"):
        assert serve_all(engine, round_id) == reference
    stats = engine.stats()
    assert stats.prefix_cache_tier_hits > 0 and alarms(engine) == 0
    engine.close()
    again = tiered(tiny_model_dir, tmp_path)
    assert serve_all(again, "restarted") == reference
    assert again.stats().num_tier_ignored_at_start == 0 and alarms(again) == 0
    again.close()
