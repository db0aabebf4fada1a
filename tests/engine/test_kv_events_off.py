"""KV events are opt-in: with kv_events_endpoint unset (the default) an engine that serves
requests, inserts into its prefix cache and evicts from it has no publisher, never imports zmq
or msgpack (so it cannot have opened a socket), and keeps no block hashes (the radix cache
hashes nothing without a sink: tests/engine/kv/test_kv_events.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.core.errors import KVEventsDisabled
from engine.core.protocol import EngineRequest
from tests.engine.engine_helpers import GREEDY, make_engine, random_prompts

REPO_ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter, so that modules other tests imported do not count. 24 prompts
# of up to 60 tokens into a 40-block pool: the prefix cache inserts and evicts.
_SERVE_WITH_DEFAULTS = """
import json, sys
sys.path.insert(0, ".")
from engine.core.protocol import EngineRequest
from tests.engine.engine_helpers import GREEDY, make_engine, random_prompts
from app.server import create_app  # the HTTP layer's imports count too

engine = make_engine(sys.argv[1], num_kv_blocks=40)
for i, prompt in enumerate(random_prompts(24, seed=5)):
    engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
print(json.dumps({
    "publisher": engine.kv_event_publisher is not None,
    "evictions": engine.stats().num_evictions,
    "modules": sorted(m for m in ("zmq", "msgpack", "engine.kv_event_publisher")
                      if m in sys.modules),
}))
"""


def test_the_default_config_turns_kv_events_off() -> None:
    assert EngineConfig().kv_events_endpoint is None


def test_serving_with_events_off_imports_no_zmq_and_has_no_publisher(tiny_model_dir) -> None:
    found = subprocess.run(
        [sys.executable, "-c", _SERVE_WITH_DEFAULTS, tiny_model_dir],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    report = json.loads(found.stdout.strip().splitlines()[-1])
    assert report["evictions"] > 0  # the cache did evict: a removal event would have been due
    assert report == {"publisher": False, "evictions": report["evictions"], "modules": []}


def test_the_cache_records_no_events_when_off(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir, num_kv_blocks=40)
    for i, prompt in enumerate(random_prompts(24, seed=6)):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats().num_evictions > 0
    assert engine.kv_event_publisher is None
    with pytest.raises(KVEventsDisabled):  # the radix cache kept no block hashes to list
        engine.kv_cache_manager.cached_block_hashes()
