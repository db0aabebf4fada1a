"""POST /debug/faults (fault drills): 403 unless enabled, the engine's report when enabled,
API keys when configured; `--enable-fault-injection` needs no value; write violations and
leaked blocks reach /metrics."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from helpers import open_client

from app.cli import build_parser
from app.settings import ServerSettings, Settings, flag_overrides, load_settings
from engine.core.config import EngineConfig
from engine.core.errors import InvalidFaultTarget
from engine.core.protocol import EngineStats, FaultReport

pytestmark = pytest.mark.anyio

CORRUPT = {"kind": "corrupt_block"}


class FaultyEngine(FakeEngine):
    """A FakeEngine that records drills and answers like LLMEngine.inject_fault."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults: list[tuple[str, int | None, int | None]] = []

    async def inject_fault(
        self, kind: str, block_id: int | None = None, other_block_id: int | None = None
    ) -> FaultReport:
        self.faults.append((kind, block_id, other_block_id))
        if block_id == 99:
            raise InvalidFaultTarget("block 99 is not in the prefix cache")
        return FaultReport(kind, [block_id or 0], f"did {kind}")


def settings(
    enable: bool, api_keys: tuple[str, ...] = (), operator_keys: tuple[str, ...] = ()
) -> Settings:
    return Settings(
        server=ServerSettings(api_keys=api_keys, operator_keys=operator_keys),
        engine=EngineConfig(enable_fault_injection=enable),
    )


@pytest.fixture
def faulty(tokenizer_dir) -> FaultyEngine:
    return FaultyEngine(tokenizer_dir)


@pytest.mark.parametrize("body", [CORRUPT, {"kind": "nonsense"}, {}])
async def test_disabled_answers_403_with_an_openai_error(faulty, body) -> None:
    async with open_client(faulty, settings(enable=False)) as client:
        response = await client.post("/debug/faults", json=body)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["code"] == "fault_injection_disabled"
    assert "--enable-fault-injection" in error["message"]
    assert faulty.faults == []


async def test_enabled_returns_what_the_engine_did(faulty) -> None:
    async with open_client(faulty, settings(enable=True)) as client:
        response = await client.post("/debug/faults", json={"kind": "wrong_block", "block_id": 3})
        assert response.status_code == 200
        expected = {"kind": "wrong_block", "block_ids": [3], "detail": "did wrong_block"}
        assert response.json() == expected
        missing = await client.post("/debug/faults", json={"kind": "corrupt_block", "block_id": 99})
        assert missing.status_code == 409
        assert "not in the prefix cache" in missing.json()["error"]["message"]
        bad = await client.post("/debug/faults", json={"kind": "flip_bits"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "kind"
    assert faulty.faults == [("wrong_block", 3, None), ("corrupt_block", 99, None)]


async def test_with_tenants_only_an_operator_key_drills(faulty) -> None:
    """A tenant key never drills the shared cache: 403 without operator_keys, 401 with."""

    async def statuses(client) -> list[int]:
        keys = [None, "k1", "op"]
        headers = [{} if key is None else {"Authorization": f"Bearer {key}"} for key in keys]
        return [
            (await client.post("/debug/faults", json=CORRUPT, headers=h)).status_code
            for h in headers
        ]

    async with open_client(faulty, settings(enable=True, api_keys=("k1",))) as client:
        assert await statuses(client) == [403, 403, 403]
    keyed = settings(enable=True, api_keys=("k1",), operator_keys=("op",))
    async with open_client(faulty, keyed) as client:
        assert await statuses(client) == [401, 401, 200]
    assert faulty.faults == [("corrupt_block", None, None)]


def test_the_flag_alone_turns_fault_injection_on() -> None:
    for argv, expected in (([], False), (["--enable-fault-injection"], True),
                           (["--enable-fault-injection", "false"], False)):  # fmt: skip
        args = build_parser().parse_args(["serve", *argv, "--audit-sample-rate", "1.0"])
        engine = load_settings("config/cpu.yaml", {}, flag_overrides(args)).engine
        assert (engine.enable_fault_injection, engine.audit_sample_rate) == (expected, 1.0)


async def test_write_violations_and_leaks_reach_the_metrics(client, engine) -> None:
    engine.publish(
        EngineStats(
            num_write_violations=2,
            num_quarantined_blocks=5,
            num_leaked_blocks=1,
            num_audits_dropped=3,
        )
    )
    text = (await client.get("/metrics")).text
    assert "kvshare_cache_write_violations_total 2.0" in text
    assert "kvshare_cache_quarantined_blocks_total 5.0" in text
    assert "kvshare_kv_blocks_leaked 1.0" in text
    assert "kvshare_cache_audits_dropped_total 3.0" in text
