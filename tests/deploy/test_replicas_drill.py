"""benchmarks/replicas.py's own arithmetic: its options, what it reads from a replica's /metrics,
the history it reports and how it pools runs into rows and the goal. The drill itself (real
replicas behind the SGLang gateway) runs by hand, never in `make test`."""

from __future__ import annotations

import pytest

from app.metrics import ServerMetrics
from benchmarks.replicas import parse_args
from benchmarks.replicas_report import Run, aggregate, block_size_in, counters, goal, history_blocks
from benchmarks.serving import RequestResult
from engine.core.protocol import EngineStats


def test_defaults_run_four_pools_with_pausing_users():
    drill, out = parse_args([])
    assert drill.pools == [None, 150, 100, 75]
    assert drill.think_time_s == 1.0
    assert drill.num_requests == {"multi-turn": 48, "many-system-prompts": 24}
    assert out is None
    drill, _ = parse_args(["--kv-blocks-per-replica", "config", "64", "--think-time", "0"])
    assert (drill.pools, drill.think_time_s) == ([None, 64], 0.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-blocks-per-replica", "0"],
        ["--kv-blocks-per-replica", "lots"],
        ["--kv-blocks-per-replica"],
        ["--think-time", "-0.5"],
        ["--rounds", "0"],
    ],
)
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_counters_and_block_size_come_from_the_servers_own_exposition():
    metrics = ServerMetrics()
    with pytest.raises(RuntimeError, match="kvshare_cache_config_info"):
        block_size_in(metrics.render().decode())  # no pool yet: no geometry sample
    stats = EngineStats(
        prefix_cache_queries=50,
        prefix_cache_hits=20,
        num_evictions=7,
        block_size=32,
        num_total_blocks=10,
    )
    metrics.observe_engine(stats)
    text = metrics.render().decode()
    assert counters(text) == (20.0, 50.0, 7.0)
    # A counter with label sets is summed over them.
    labelled = (
        'kvshare_kv_evictions_total{pool="a"} 2.0\nkvshare_kv_evictions_total{pool="b"} 3.0\n'
    )
    assert counters(labelled) == (0.0, 0.0, 5.0)
    assert block_size_in(text) == 32


def _result(conversation_id: int, turn: int, prompt: int, output: int, ok: bool = True):
    return RequestResult(conversation_id, turn, ok=ok, prompt_tokens=prompt, output_tokens=output)


def test_history_counts_the_full_blocks_of_each_conversations_last_completed_turn():
    # The KV of a history is its prompt and its answer but the answer's last token.
    results = [
        _result(0, 0, 40, 16),
        _result(1, 0, 32, 16),
        _result(0, 1, 81, 16),  # 97 tokens, 96 with KV: 6 full blocks of 16
        _result(1, 1, 64, 16, ok=False),  # failed: conversation 1 ends at turn 0 (47: 2 blocks)
        _result(2, 0, 16, 16),  # 32 tokens, 31 with KV: 1 full block
    ]
    assert history_blocks(results, block_size=16) == 6 + 2 + 1
    assert history_blocks([], block_size=16) == 0


def _run(target: str, round_index: int, hits: float, queries: float, workload="multi-turn"):
    summary = {"output_tokens": 10, "duration_s": 2.0, "completed": 4, "num_requests": 4}
    return Run(
        pool=100,
        round=round_index,
        target=target,
        workload=workload,
        seed=round_index,
        hits=hits,
        queries=queries,
        per_replica_queries=[queries / 2, queries / 2],
        evicted_blocks=3,
        history_blocks=20 + round_index,
        summary=summary,
        ttft_s=[0.1 * (round_index + 1)],
    )


def test_rows_pool_the_rounds_by_tokens_and_the_goal_compares_hit_rates():
    runs = [
        _run("cache_aware", 0, 70, 100),
        _run("cache_aware", 1, 80, 100),
        _run("round_robin", 0, 40, 100),
        _run("round_robin", 1, 60, 200),
        _run("single", 0, 76, 100),
        _run("single", 1, 74, 100),
    ]
    rows = aggregate(runs)
    rate = {r["target"]: r["hit_rate"] for r in rows}
    assert rate == pytest.approx({"cache_aware": 0.75, "round_robin": 100 / 300, "single": 0.75})
    row = rows[0]
    assert (row["completed"], row["planned"], row["history_blocks"]) == (8, 8, 21)
    assert row["evicted_blocks"] == 6
    assert row["output_tok_s"] == pytest.approx(5.0)
    assert row["replica_query_split"] == [100, 100]
    check = goal(rows)
    assert check["cache_aware_vs_single"] == pytest.approx(1.0)
    assert check["cache_aware_vs_round_robin"] == pytest.approx(2.25)
    assert check["met"] is True
    # Round-robin at 0.6: cache_aware is 1.25x of it, under the 1.5x goal.
    close = [_run("cache_aware", 0, 75, 100), _run("round_robin", 0, 60, 100)]
    close.append(_run("single", 0, 75, 100))
    assert goal(aggregate(close))["met"] is False
