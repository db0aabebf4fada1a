"""The layer rules of the layout (docs/architecture.md), one per folder, and a checker for them.

A rule names a folder (every .py file under it, found by walking it) or one file, and what
its modules may import. A module that moves is checked where it lands; a rule whose folder
holds no module (besides __init__.py) is itself a violation: a moved layer takes its rule
along, the check never turns into a skip.

Imports are read from the source with `ast`, not by importing it. Every `import` and
`from ... import` counts wherever it stands: module level, inside functions, in `try` blocks,
and under `if TYPE_CHECKING:` (a type-only import of torch still ties core/ to torch's API),
and so does `importlib.import_module("literal")`. Relative imports are resolved against the
module's package; `from pkg import name` counts as importing `pkg.name` when that is a module
of the repository, else as importing `pkg`.

What a module loads when it runs (its imports' imports) is checked separately, in a fresh
interpreter, by `loaded_after_import`. That check is kept for the torch-free layers and
app/'s entry points; the web-stack rule for all of engine/ stays static, because a library
the runtime uses (xgrammar) may load pydantic itself.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCH_STACK = ("torch", "transformers", "triton")
WEB_STACK = ("fastapi", "starlette", "pydantic", "uvicorn")
FIRST_PARTY = ("engine", "app")
APP_TOP = ("app.routes", "app.server", "app.cli")  # what app/'s folders never import
APP_APIS = ("openai", "responses", "anthropic")  # app/'s folder per API


@dataclass(frozen=True)
class Rule:
    """The modules under `path` import nothing in `forbidden` (a name and its submodules); when
    `first_party` is set, their imports of engine/app modules all lie within it."""

    path: str  # a folder or a .py file, relative to the repository root
    forbidden: tuple[str, ...]
    first_party: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return self.path


RULES = (
    # The core: the plain data every layer shares. Torch-free, web-free; it imports no other layer.
    Rule("engine/core", TORCH_STACK + WEB_STACK, ("engine.core",)),
    # The KV memory: torch-free, web-free, built on the core's plain data alone.
    Rule("engine/kv", TORCH_STACK + WEB_STACK, ("engine.core", "engine.kv")),
    # The scheduler: torch-free, web-free; of the KV memory it sees only the facade (never the
    # radix cache or the block pool).
    Rule(
        "engine/sched",
        TORCH_STACK + WEB_STACK,
        ("engine.core", "engine.kv.kv_cache_manager", "engine.sched"),
    ),
    Rule("engine/tokenizer.py", TORCH_STACK + WEB_STACK, ("engine.core", "engine.chat_template")),
    Rule("engine/chat_template.py", TORCH_STACK + WEB_STACK, ("engine.core",)),
    # The simulated runner: the scheduler over real KV memory, with no model and no torch.
    Rule(
        "engine/simulation.py",
        TORCH_STACK + WEB_STACK,
        ("engine.core", "engine.kv", "engine.sched", "engine.simulation"),
    ),
    # The torch runtime runs what the scheduler hands it: it knows no KV manager, audit or driver.
    Rule("engine/runtime", WEB_STACK, ("engine.core", "engine.runtime")),
    # The runtime's subpackages never import up into engine/runtime's own modules (loader,
    # model_runner...); across them: models use attention's interface and the cpu kernels,
    # attention builds its cpu backend on the native library, the cpu kernels take
    # attention's metadata.
    Rule(
        "engine/runtime/attention",
        WEB_STACK,
        ("engine.core", "engine.runtime.attention", "engine.runtime.cpu.native"),
    ),
    Rule(
        "engine/runtime/cpu",
        WEB_STACK,
        ("engine.core", "engine.runtime.cpu", "engine.runtime.attention.base"),
    ),
    Rule(
        "engine/runtime/models",
        WEB_STACK,
        (
            "engine.core",
            "engine.runtime.models",
            "engine.runtime.attention.base",
            "engine.runtime.cpu",
        ),
    ),
    Rule("engine/audit", WEB_STACK, ("engine.core", "engine.kv", "engine.runtime", "engine.audit")),
    # No engine module imports the web stack or app/ (app -> engine, never back).
    Rule("engine", (*WEB_STACK, "app")),
    # app/ never imports torch (cli.py builds the engine through engine modules, lazily).
    Rule("app", TORCH_STACK),
    # app/'s folders lie under the routes and the server, which only the server and the CLI
    # import; what the server tells about its cache (diagnostics/) knows no API.
    *(Rule(f"app/{folder}", APP_TOP) for folder in (*APP_APIS, "serving")),
    Rule("app/diagnostics", (*APP_TOP, "app.serving", *(f"app.{api}" for api in APP_APIS))),
    # The benchmarks never import tests/ (what both need lives in benchmarks/ or engine/; the
    # tests may import the benchmarks).
    Rule("benchmarks", ("tests",)),
)
# The layers that load neither torch nor the web stack, at run time too (loaded_after_import).
TORCH_FREE_RULES = tuple(r for r in RULES if set(TORCH_STACK + WEB_STACK) <= set(r.forbidden))


def module_files(rule: Rule, root: Path = REPO_ROOT) -> list[Path]:
    """The .py files a rule covers, sorted."""
    target = root / rule.path
    if target.suffix == ".py":
        return [target] if target.is_file() else []
    if not target.is_dir():
        return []
    return sorted(p for p in target.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(file: Path, root: Path = REPO_ROOT) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(file: Path, root: Path = REPO_ROOT) -> Iterator[tuple[int, str]]:
    """(line, dotted module name) of every import in `file`, wherever it stands."""
    name = module_name(file, root)
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield node.lineno, submodule if _is_repo_module(submodule, root) else base
        elif _is_import_module_call(node):
            yield node.lineno, node.args[0].value


def _absolute(module: str | None, level: int, package: str) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_repo_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_import_module_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(rule: Rule, root: Path = REPO_ROOT) -> list[str]:
    """'path:line: imports NAME' for each import that breaks `rule`; a rule that finds no
    module to check is one violation too."""
    files = module_files(rule, root)
    if not any(file.name != "__init__.py" for file in files):
        return [f"{rule.path}: no module to check (did the layer move? move its rule)"]
    found = []
    for file in files:
        where = file.relative_to(root).as_posix()
        for line, name in imported_modules(file, root):
            is_first_party = name.partition(".")[0] in FIRST_PARTY
            if _within(name, rule.forbidden) or (
                rule.first_party is not None
                and is_first_party
                and not _within(name, rule.first_party)
            ):
                found.append(f"{where}:{line}: imports {name}")
    return found


def loaded_after_import(
    modules: list[str], candidates: tuple[str, ...], root: Path = REPO_ROOT
) -> dict[str, list[str]]:
    """One fresh interpreter (in `root`) imports `modules` in order: per module, which of
    `candidates` (or their submodules) it was the first to load."""
    code = (
        "import importlib, json, sys\n"
        f"candidates = {list(candidates)!r}\n"
        "def loaded():\n"
        "    return {c for c in candidates for m in sys.modules"
        " if m == c or m.startswith(c + '.')}\n"
        "result, before = {}, loaded()\n"
        f"for module in {list(modules)!r}:\n"
        "    importlib.import_module(module)\n"
        "    now = loaded()\n"
        "    result[module], before = sorted(now - before), now\n"
        "print(json.dumps(result))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (any import, as imported_modules reads
    them), for every .py file under root/package."""
    files = {module_name(file, root): file for file in sorted((root / package).rglob("*.py"))}
    return {
        module: {name for _, name in imported_modules(file, root) if name in files} - {module}
        for module, file in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle is not None:
            return cycle
    return None
