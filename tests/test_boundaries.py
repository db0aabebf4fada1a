"""Import boundaries, checked in fresh interpreters (see DESIGN.md, module map).

app/ never loads torch; the engine core never loads torch nor the web stack.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
WEB_STACK = ("fastapi", "starlette", "pydantic", "uvicorn")
TORCH = ("torch", "transformers")
ENGINE_CORE = (
    "engine.core.protocol",
    "engine.core.sampling_params",
    "engine.core.config",
    "engine.core.batch",
    "engine.kv.block_pool",
    "engine.tokenizer",
    "engine.core.sequence",
    "engine.kv.radix_cache",
    "engine.kv.kv_cache_manager",
    "engine.core.admission",
    "engine.core.scheduler",
)


def loaded_after_import(module: str, candidates: tuple[str, ...]) -> list[str]:
    """Which of `candidates` a fresh interpreter has loaded after `import module`."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps([m for m in {list(candidates)!r} if m in sys.modules]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


def _require(module: str) -> None:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")


@pytest.mark.parametrize("module", ["app.server", "app.cli"])
def test_app_does_not_load_torch(module: str) -> None:
    assert loaded_after_import(module, TORCH) == []


@pytest.mark.parametrize("module", ENGINE_CORE)
def test_engine_core_loads_neither_torch_nor_the_web_stack(module: str) -> None:
    _require(module)
    assert loaded_after_import(module, TORCH + WEB_STACK) == []
