"""app/ has no import cycle: every import counts, TYPE_CHECKING and function-level ones too.

The layout rule: streaming.py imports no serving. A cycle hidden behind TYPE_CHECKING still ties
two modules together (and breaks at runtime the day someone drops the guard), so the checker
reads the source with ast instead of importing it.
"""

from __future__ import annotations

from pathlib import Path

from tests.boundary_rules import REPO_ROOT, find_cycle, import_graph


def test_app_has_no_import_cycle() -> None:
    graph = import_graph(REPO_ROOT, "app")
    assert {"app.serving.service", "app.streaming", "app.routes.chat"} <= set(graph)  # read app/
    assert "app.serving.service" in graph["app.routes.deps"]  # and it sees imports
    assert find_cycle(graph) is None


def test_streaming_imports_no_serving() -> None:
    imported = import_graph(REPO_ROOT, "app")["app.streaming"]
    assert imported and not [name for name in imported if name.startswith("app.serving")]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


CLEAN = {
    "pkg/__init__.py": "",
    "pkg/serving.py": "from pkg.streaming import merge\nfrom pkg import errors\n",
    "pkg/streaming.py": "from pkg.errors import APIError\n",
    "pkg/errors.py": "import json\n",
    "pkg/routes/__init__.py": "",
    "pkg/routes/chat.py": "from ..serving import run\nfrom . import deps\n",
    "pkg/routes/deps.py": "from pkg.serving import run\n",
}


def test_the_checker_passes_a_package_without_cycles(tmp_path) -> None:
    _write(tmp_path, CLEAN)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.serving"] == {"pkg.streaming", "pkg.errors"}
    assert graph["pkg.routes.chat"] == {"pkg.serving", "pkg.routes.deps"}  # relative imports
    assert find_cycle(graph) is None


def test_the_checker_finds_a_cycle_behind_type_checking(tmp_path) -> None:
    bad_streaming = (
        "from typing import TYPE_CHECKING\n"
        "from pkg.errors import APIError\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.serving import OpenAIServing\n"
    )
    _write(tmp_path, {**CLEAN, "pkg/streaming.py": bad_streaming})
    assert find_cycle(import_graph(tmp_path, "pkg")) == [
        "pkg.serving",
        "pkg.streaming",
        "pkg.serving",
    ]


def test_the_checker_finds_a_longer_cycle_through_a_function_level_import(tmp_path) -> None:
    bad_errors = "def render():\n    from pkg.routes import chat\n"
    _write(tmp_path, {**CLEAN, "pkg/errors.py": bad_errors})
    cycle = find_cycle(import_graph(tmp_path, "pkg"))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"pkg.errors", "pkg.routes.chat", "pkg.serving"} <= set(cycle)
