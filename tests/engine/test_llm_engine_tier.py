"""The second KV tier in the engine, on the tiny random Llama in the exact mode (float32): a
block loaded back from the tier holds the bytes a recompute gives and greedy tokens equal the
cache-off engine's; restored KV is audited at its own rate and wrong KV under a valid checksum
is caught and never served again; the disk tier survives a restart with namespaces apart, and
a restart under another fingerprint or a corrupt file serves nothing wrong."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.core.protocol import EngineRequest
from engine.core.sequence import make_namespace
from engine.kv.tier_format import EntryHead, decode_entry, encode_entry, entry_key
from engine.llm_engine import LLMEngine
from engine.runtime.block_io import read_blocks
from tests.engine.engine_helpers import GREEDY, VOCAB, make_engine

BS = 16
POOL = dict(num_kv_blocks=16, max_num_seqs=4)  # 256 tokens: 100-token prompts overflow it


def prompt(seed: int, num: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(num)]


A, B, C = prompt(1), prompt(2), prompt(3)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[tuple[int, ...], list[int]]:
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    prompts = [A, B, C]
    results = engine.generate(prompts, GREEDY)
    return {tuple(p): r.token_ids[0] for p, r in zip(prompts, results, strict=True)}


def serve(engine: LLMEngine, tokens: list[int], request_id: str, salt: str | None = None):
    """Run one request alone; (its greedy tokens, its cached tokens)."""
    engine.add_request(EngineRequest(request_id, tokens, GREEDY, cache_salt=salt))
    output_tokens, cached = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            output_tokens += output.outputs[0].new_token_ids
            cached = output.num_cached_tokens
        engine.scheduler.check_integrity()
    assert engine.stats().num_leaked_blocks == 0
    return output_tokens, cached


def push_out(engine: LLMEngine, salt: str | None = None) -> None:
    """A's blocks leave the pool for the tier."""
    for index, other in enumerate((B, C, prompt(6))):
        serve(engine, other, f"push-{index}", salt)
    assert engine.kv_cache_manager.prefix_cache.match(_ns(engine, salt), A).num_matched_tokens == 0


def _ns(engine: LLMEngine, salt: str | None = None):
    return make_namespace(engine.model_info.weights_version, None, salt)


def cached_block_bytes(engine: LLMEngine, tokens: list[int], salt: str | None = None):
    match = engine.kv_cache_manager.prefix_cache.match(_ns(engine, salt), tokens)
    return read_blocks(engine.runner.kv_caches, list(match.full_block_ids))


def test_a_tier_hit_holds_the_bytes_of_a_recompute_and_gives_the_same_tokens(
    tiny_model_dir, reference
) -> None:
    engine = make_engine(tiny_model_dir, kv_tier="host", **POOL)
    recompute = make_engine(tiny_model_dir, **POOL)
    assert serve(recompute, A, "a")[0] == reference[tuple(A)]
    serve(engine, A, "a1")
    push_out(engine)
    tokens, cached = serve(engine, A, "a2")
    assert tokens == reference[tuple(A)]
    assert cached == 96 and engine.stats().prefix_cache_tier_hits == 96
    restored = cached_block_bytes(engine, A)
    assert len(restored) == 6
    assert restored == cached_block_bytes(recompute, A)  # bit-identical, every layer's K and V
    assert engine.stats().num_leaked_blocks == 0


def test_restored_kv_is_audited_at_its_own_rate(tiny_model_dir, reference) -> None:
    engine = make_engine(
        tiny_model_dir,
        kv_tier="host",
        audit_sample_rate=0.0,
        audit_restored_sample_rate=1.0,
        num_kv_blocks=24,
    )
    serve(engine, A, "a1")
    serve(engine, B, "b")  # a pool hit would not be audited at rate 0
    serve(engine, B, "b2")
    assert engine.stats().num_audits == 0
    for index, other in enumerate((C, prompt(4), prompt(5))):
        serve(engine, other, f"x{index}")
    assert serve(engine, A, "a2")[0] == reference[tuple(A)]
    stats = engine.stats()
    assert stats.prefix_cache_tier_hits > 0
    assert stats.num_restore_audits == stats.num_audits == 1
    assert stats.num_restore_audit_corruptions == stats.num_audit_corruptions == 0


def test_wrong_kv_under_a_valid_checksum_is_quarantined_in_the_tier_too(tiny_model_dir) -> None:
    engine = make_engine(
        tiny_model_dir, kv_tier="host", audit_restored_sample_rate=1.0, num_kv_blocks=24
    )
    serve(engine, A, "a1")
    for index, other in enumerate((B, C, prompt(4), prompt(5))):
        serve(engine, other, f"x{index}")
    tier, ns = engine.kv_tier, _ns(engine)
    assert tier.match(ns, A, 0, 6) == 6
    # Block 1's entry re-written with block 2's KV: well-formed, checksum valid, KV wrong.
    _, wrong = decode_entry(tier.store.get(entry_key(ns, A[: 3 * BS])))
    path = tuple(A[: 2 * BS])
    forged = encode_entry(EntryHead(tier.fingerprint, ns, path, len(wrong)), wrong)
    tier.store.put(entry_key(ns, path), forged)
    serve(engine, A, "a2")
    stats = engine.stats()
    assert stats.num_tier_checksum_failures == 0
    assert stats.num_restore_audit_corruptions == 1 and stats.num_quarantined_blocks >= 1
    assert tier.match(ns, A, 0, 6) == 1  # block 1 and all after it dropped from the tier
    assert serve(engine, A, "a3")[1] == BS  # block 0 only: nothing wrong is served again


def disk_engine(model_dir: str, directory: Path, **options) -> LLMEngine:
    return make_engine(model_dir, kv_tier="disk", kv_tier_dir=str(directory), **POOL, **options)


def saved_after_a(model_dir: str, directory: Path) -> LLMEngine:
    """An engine that served A and stopped gracefully (its cached blocks are on disk)."""
    first = disk_engine(model_dir, directory)
    serve(first, A, "a1")
    first.close()
    return first


def test_a_restart_serves_the_tier_within_its_namespace_only(
    tiny_model_dir, reference, tmp_path
) -> None:
    first = disk_engine(tiny_model_dir, tmp_path)
    serve(first, A, "a1", salt="tenant-1")
    first.close()  # graceful: the pool's cached blocks are written
    again = disk_engine(tiny_model_dir, tmp_path)
    assert again.stats().num_tier_restored_at_start >= 6
    tokens, cached = serve(again, A, "a2", salt="tenant-2")
    assert cached == 0 and tokens == reference[tuple(A)]
    tokens, cached = serve(again, A, "a3", salt="tenant-1")
    assert cached == 96 and tokens == reference[tuple(A)]
    assert again.stats().prefix_cache_tier_hits == 96
    again.close()


def test_a_restart_under_another_fingerprint_ignores_every_entry(
    tiny_model_dir, reference, tmp_path
) -> None:
    saved_after_a(tiny_model_dir, tmp_path)
    num_files = len(list(tmp_path.glob("*.kvb")))
    assert num_files >= 6
    other = disk_engine(tiny_model_dir, tmp_path, kv_cache_dtype="float16")
    stats = other.stats()
    assert stats.num_tier_ignored_at_start == num_files and stats.kv_tier_entries == 0
    assert serve(other, A, "a2")[1] == 0
    other.close()


def test_a_corrupt_file_after_a_restart_is_detected_and_recomputed(
    tiny_model_dir, reference, tmp_path
) -> None:
    first = saved_after_a(tiny_model_dir, tmp_path)
    path = tmp_path / f"{entry_key(_ns(first), A[: 3 * BS])}.kvb"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x04  # one bit of block 2's payload
    path.write_bytes(bytes(data))
    again = disk_engine(tiny_model_dir, tmp_path)
    tokens, cached = serve(again, A, "a2")
    assert tokens == reference[tuple(A)]
    assert cached == 2 * BS  # blocks 0 and 1; block 2 on is computed
    assert again.stats().num_tier_checksum_failures == 1
    again.close()


def test_a_save_under_a_small_cap_keeps_a_prompts_first_blocks(tiny_model_dir, tmp_path) -> None:
    entry = tier_entry_bytes(tiny_model_dir, tmp_path / "probe")
    first = disk_engine(tiny_model_dir, tmp_path, kv_tier_max_bytes=3 * entry + 4000)
    serve(first, A, "a1")
    first.close()
    first.close()  # safe again
    again = disk_engine(tiny_model_dir, tmp_path)
    assert serve(again, A, "a2")[1] == 3 * BS  # blocks 0-2, from position 0: usable
    again.close()


def test_a_save_keeps_a_tenant_at_its_cap(tiny_model_dir, tmp_path) -> None:
    capped = dict(max_cached_blocks_per_namespace=6)
    first = disk_engine(tiny_model_dir, tmp_path, **capped)
    serve(first, A, "a1", salt="tenant")  # its 6 blocks fill its cap in the pool
    first.close()
    again = disk_engine(tiny_model_dir, tmp_path, **capped)
    assert serve(again, A, "a2", salt="tenant")[1] == 96
    again.close()


def tier_entry_bytes(model_dir: str, directory: Path) -> int:
    """The bytes of one saved entry of A's first block."""
    engine = disk_engine(model_dir, directory)
    serve(engine, A[:20], "probe")
    engine.close()
    (path,) = directory.glob("*.kvb")
    return path.stat().st_size


def test_a_step_that_fails_before_its_loads_drops_them_and_their_audits(
    tiny_model_dir, reference, monkeypatch
) -> None:
    engine = make_engine(
        tiny_model_dir, kv_tier="host", audit_restored_sample_rate=1.0, num_kv_blocks=24
    )
    serve(engine, A, "a1")
    for index, other in enumerate((B, C, prompt(4), prompt(5))):
        serve(engine, other, f"x{index}")
    launch = engine.runner.launch

    def fails(sched_out, previous=None):
        assert sched_out.block_loads
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", fails)
    engine.add_request(EngineRequest("a2", A, GREEDY))
    outputs = []
    while not outputs:  # the first steps wait while its tier blocks are read
        outputs = engine.step()
    (output,) = outputs
    assert output.error is not None and "device lost" in output.error
    monkeypatch.setattr(engine.runner, "launch", launch)
    stats = engine.stats()
    assert stats.num_audits_dropped == 1 and stats.num_audit_corruptions == 0
    assert engine.kv_cache_manager.prefix_cache.match(_ns(engine), A).num_matched_tokens == 0
    tokens, cached = serve(engine, A, "a3")  # loaded again, written this time
    assert tokens == reference[tuple(A)] and cached == 96
    assert engine.stats().num_audit_corruptions == 0
