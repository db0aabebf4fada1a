"""Fixtures for the HTTP layer: a tiny tokenizer, a FakeEngine, an in-process client."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

# The helper modules beside this file import as top-level modules, whatever the import mode.
sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine
from helpers import open_client
from tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own cache dir: the response store's SQLite file lands there."""
    monkeypatch.setenv("KVSHARE_CACHE_DIR", str(tmp_path / "kvshare-cache"))
    return tmp_path / "kvshare-cache"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(tokenizer_dir: Path) -> FakeEngine:
    return FakeEngine(tokenizer_dir)


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    async with open_client(engine) as client:
        yield client
