"""Import boundaries (docs/architecture.md): the rules of tests/boundary_rules.py hold on the
repository, per folder, statically and in fresh interpreters; and the checker fails on a copy
of the layers with a bad import added.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.boundary_rules import (
    REPO_ROOT,
    RULES,
    TORCH_FREE_RULES,
    TORCH_STACK,
    WEB_STACK,
    Rule,
    loaded_after_import,
    module_files,
    module_name,
    violations,
)

RULES_BY_PATH = {rule.path: rule for rule in RULES}


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_rule_holds(rule: Rule) -> None:
    assert violations(rule) == []


@pytest.mark.parametrize("rule", TORCH_FREE_RULES, ids=str)
def test_torch_free_layers_load_neither_torch_nor_the_web_stack(rule: Rule) -> None:
    modules = [module_name(file) for file in module_files(rule)]
    assert modules  # violations() says so too; here it would pass on nothing
    loaded = loaded_after_import(modules, TORCH_STACK + WEB_STACK)
    assert loaded == {module: [] for module in modules}


@pytest.mark.parametrize("module", ["app.server", "app.cli"])
def test_app_does_not_load_torch(module: str) -> None:
    assert loaded_after_import([module], TORCH_STACK) == {module: []}


# -- the checker itself, on a copy of the layers -----------------------------------------------
@pytest.fixture
def layers(tmp_path: Path) -> Path:
    """A copy of engine/__init__.py, engine/core, engine/kv, engine/sched, engine/runtime and
    benchmarks/ (without its results): a minimal engine package and its benchmarks."""
    (tmp_path / "engine").mkdir()
    shutil.copy(REPO_ROOT / "engine" / "__init__.py", tmp_path / "engine")
    folders = ["engine/core", "engine/kv", "engine/sched", "engine/runtime", "benchmarks"]
    for folder in folders:
        shutil.copytree(
            REPO_ROOT / folder,
            tmp_path / folder,
            ignore=shutil.ignore_patterns("__pycache__", "results"),
        )
    return tmp_path


def append(root: Path, path: str, code: str) -> int:
    """Append `code` to the module at `path`; the line its last line lands on."""
    file = root / path
    text = file.read_text().rstrip("\n") + "\n\n" + code.strip("\n") + "\n"
    file.write_text(text)
    return len(text.splitlines())


BAD_IMPORTS = [
    # (module, code appended, rule, the module it imports), id
    pytest.param("engine/core/batch.py", "import torch", "engine/core", "torch", id="core-torch"),
    pytest.param("engine/kv/block_pool.py", "import torch", "engine/kv", "torch", id="kv-torch"),
    pytest.param(
        "engine/core/sampling_params.py",
        "def f():\n    from torch import nn",
        "engine/core",
        "torch",
        id="core-torch-in-a-function",
    ),
    pytest.param(
        "engine/kv/radix_cache.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import torch.nn",
        "engine/kv",
        "torch.nn",
        id="kv-torch-for-type-checking",
    ),
    pytest.param(
        "engine/kv/block_pool.py",
        "import importlib\n\ntorch = importlib.import_module('torch')",
        "engine/kv",
        "torch",
        id="kv-torch-by-import_module",
    ),
    pytest.param(
        "engine/kv/kv_cache_manager.py",
        "import transformers",
        "engine/kv",
        "transformers",
        id="kv-transformers",
    ),
    pytest.param(
        "engine/core/config.py", "import pydantic", "engine/core", "pydantic", id="core-pydantic"
    ),
    pytest.param(
        "engine/core/config.py", "import pydantic", "engine", "pydantic", id="engine-pydantic"
    ),
    pytest.param(
        "engine/core/protocol.py",
        "from fastapi import FastAPI",
        "engine",
        "fastapi",
        id="engine-fastapi",
    ),
    pytest.param(
        "engine/kv/block_pool.py", "from app import server", "engine", "app", id="engine-app"
    ),
    pytest.param(
        "engine/core/batch.py",
        "from engine.kv.radix_cache import RadixCache",
        "engine/core",
        "engine.kv.radix_cache",
        id="core-radix-cache",
    ),
    pytest.param(
        "engine/core/batch.py",
        "from ..kv import block_pool",
        "engine/core",
        "engine.kv.block_pool",
        id="core-block-pool-relative",
    ),
    pytest.param(
        "engine/core/batch.py",
        "import engine.runtime.sampler",
        "engine/core",
        "engine.runtime.sampler",
        id="core-runtime",
    ),
    pytest.param(
        "engine/kv/radix_cache.py",
        "from engine.runtime import sampler",
        "engine/kv",
        "engine.runtime.sampler",
        id="kv-runtime",
    ),
    pytest.param(
        "engine/kv/radix_cache.py",
        "from engine import llm_engine",
        "engine/kv",
        "engine",
        id="kv-driver",
    ),
    pytest.param(
        "engine/core/batch.py",
        "from engine.kv.kv_cache_manager import KVCacheManager",
        "engine/core",
        "engine.kv.kv_cache_manager",
        id="core-kv-facade",
    ),
    pytest.param(
        "engine/core/sequence.py",
        "from engine.sched import scheduler",
        "engine/core",
        "engine.sched.scheduler",
        id="core-sched",
    ),
    pytest.param(
        "engine/kv/kv_cache_manager.py",
        "from engine.sched.scheduler import Scheduler",
        "engine/kv",
        "engine.sched.scheduler",
        id="kv-sched",
    ),
    pytest.param(
        "engine/kv/block_pool.py",
        "from ..sched import fair_share",
        "engine/kv",
        "engine.sched.fair_share",
        id="kv-sched-relative",
    ),
    pytest.param(
        "engine/sched/scheduler.py", "import torch", "engine/sched", "torch", id="sched-torch"
    ),
    pytest.param(
        "engine/sched/step_builder.py",
        "from engine.kv.radix_cache import RadixCache",
        "engine/sched",
        "engine.kv.radix_cache",
        id="sched-radix-cache",
    ),
    pytest.param(
        "engine/sched/admission.py",
        "from ..kv import block_pool",
        "engine/sched",
        "engine.kv.block_pool",
        id="sched-block-pool-relative",
    ),
    pytest.param(
        "engine/sched/fair_share.py",
        "from engine.runtime import sampler",
        "engine/sched",
        "engine.runtime.sampler",
        id="sched-runtime",
    ),
    pytest.param(
        "engine/sched/request_table.py",
        "from engine import llm_engine",
        "engine/sched",
        "engine",
        id="sched-driver",
    ),
    pytest.param(
        "engine/runtime/attention/select.py",
        "def f():\n    from engine.runtime.loader import kvshare_cache_dir",
        "engine/runtime/attention",
        "engine.runtime.loader",
        id="attention-loader-in-a-function",
    ),
    pytest.param(
        "engine/runtime/attention/torch_ref.py",
        "from engine.runtime.cpu import quant",
        "engine/runtime/attention",
        "engine.runtime.cpu.quant",
        id="attention-cpu-beyond-native",
    ),
    pytest.param(
        "engine/runtime/cpu/quant.py",
        "from engine.runtime.model_runner import ModelRunner",
        "engine/runtime/cpu",
        "engine.runtime.model_runner",
        id="cpu-model-runner",
    ),
    pytest.param(
        "engine/runtime/cpu/linear.py",
        "from engine.runtime.attention import select",
        "engine/runtime/cpu",
        "engine.runtime.attention.select",
        id="cpu-attention-beyond-base",
    ),
    pytest.param(
        "engine/runtime/models/llama.py",
        "from .. import sampler",
        "engine/runtime/models",
        "engine.runtime.sampler",
        id="models-parent-relative",
    ),
    pytest.param(
        "benchmarks/prefix_cache.py",
        "from tests.integration.server import running_server",
        "benchmarks",
        "tests.integration.server",
        id="benchmarks-tests",
    ),
    pytest.param(
        "benchmarks/spec_decode.py",
        "def f():\n    import tests.oracle",
        "benchmarks",
        "tests.oracle",
        id="benchmarks-tests-in-a-function",
    ),
]


@pytest.mark.parametrize(("path", "code", "rule_path", "imported"), BAD_IMPORTS)
def test_the_checker_fails_on_a_bad_import(
    layers: Path, path: str, code: str, rule_path: str, imported: str
) -> None:
    rule = RULES_BY_PATH[rule_path]
    before = violations(rule, layers)  # today's state of the copied layers, whatever it is
    line = append(layers, path, code)
    added = [v for v in violations(rule, layers) if v not in before]
    assert added == [f"{path}:{line}: imports {imported}"]


def test_the_checker_accepts_what_the_rules_allow(layers: Path) -> None:
    paths = ["engine/core", "engine/kv", "engine/sched", "engine/runtime/attention"]
    paths += ["engine/runtime/cpu", "engine/runtime/models", "benchmarks"]
    rules = [RULES_BY_PATH[path] for path in paths]
    before = [violations(rule, layers) for rule in rules]
    append(layers, "engine/core/batch.py", "from engine.core.sampling_params import SamplingParams")
    append(layers, "engine/core/config.py", "from . import errors")
    append(layers, "engine/kv/block_pool.py", "from engine.core.batch import BlockCopy")
    append(layers, "engine/kv/radix_cache.py", "from . import block_pool\nimport json")
    append(
        layers, "engine/sched/admission.py", "from engine.kv.kv_cache_manager import KVCacheManager"
    )
    append(layers, "engine/sched/fair_share.py", "from engine.kv import kv_cache_manager")
    append(
        layers,
        "engine/sched/step_builder.py",
        "from . import fair_share\nfrom engine.core import batch",
    )
    append(layers, "engine/runtime/attention/torch_ref.py", "from engine.runtime.cpu import native")
    append(layers, "engine/runtime/cpu/quant.py", "from ..attention.base import AttentionMetadata")
    append(
        layers,
        "engine/runtime/models/llama.py",
        "from engine.runtime.cpu import linear\nfrom engine.core import errors",
    )
    append(layers, "benchmarks/prefix_cache.py", "from benchmarks import serving\nimport engine")
    assert [violations(rule, layers) for rule in rules] == before


@pytest.mark.parametrize(
    "rule_path",
    ["engine/core", "engine/kv", "engine/sched", "engine/tokenizer.py", "engine/runtime/models"],
)
def test_a_rule_without_modules_fails(layers: Path, rule_path: str) -> None:
    rule = RULES_BY_PATH[rule_path]
    target = layers / rule.path
    if target.is_dir():  # only __init__.py left, as if the layer had moved away
        for file in target.rglob("*.py"):
            if file.name != "__init__.py":
                file.unlink()
    assert violations(rule, layers) == [
        f"{rule.path}: no module to check (did the layer move? move its rule)"
    ]


def test_the_fresh_interpreter_check_sees_a_torch_import(layers: Path) -> None:
    append(layers, "engine/core/batch.py", "import torch")
    loaded = loaded_after_import(
        ["engine.core.sampling_params", "engine.core.batch"], TORCH_STACK, layers
    )
    assert loaded == {"engine.core.sampling_params": [], "engine.core.batch": ["torch"]}
