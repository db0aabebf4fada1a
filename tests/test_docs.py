"""The documentation site: it builds with `mkdocs build --strict`, a broken internal link fails
that build, and the reference pages generated from the code are current."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("gen_docs_ref", REPO / "scripts" / "gen_docs_ref.py")
gen_docs_ref = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gen_docs_ref)
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict"]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MKDOCS, "--config-file", str(root / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied, the vendored mermaid left out (it is big and needs no check)."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.min.js"))
    (tmp_path / "docs" / "assets" / "javascripts" / "mermaid.min.js").write_text("")
    return tmp_path


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    architecture = (tmp_path / "site" / "architecture.html").read_text()
    assert '<pre class="mermaid">' in architecture  # the diagram is a mermaid fence
    assert "assets/javascripts/mermaid.min.js" in architecture  # served locally, not a CDN


def test_the_copy_builds_until_one_internal_link_breaks(docs_copy: Path) -> None:
    good = build(docs_copy, docs_copy / "site")
    assert good.returncode == 0, good.stdout + good.stderr
    page = docs_copy / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    broken = build(docs_copy, docs_copy / "site2")
    assert broken.returncode != 0
    assert "no-such-page.md" in broken.stdout + broken.stderr


def test_a_missing_anchor_fails_the_build(docs_copy: Path) -> None:
    page = docs_copy / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [caps](api.md#no-such-section).\n")
    broken = build(docs_copy, docs_copy / "site")
    assert broken.returncode != 0
    assert "no-such-section" in broken.stdout + broken.stderr


def test_the_reference_pages_are_current() -> None:
    assert gen_docs_ref.stale_pages() == [], "run python scripts/gen_docs_ref.py"


def test_the_staleness_check_sees_an_edit(tmp_path: Path, monkeypatch) -> None:
    shutil.copytree(gen_docs_ref.REFERENCE_DIR, tmp_path / "reference")
    monkeypatch.setattr(gen_docs_ref, "REFERENCE_DIR", tmp_path / "reference")
    page = tmp_path / "reference" / "metrics.md"
    page.write_text(page.read_text().replace("kvshare_kv_blocks_leaked", "kvshare_kv_lost", 1))
    assert gen_docs_ref.stale_pages() == ["docs/reference/metrics.md"]
    assert gen_docs_ref.main(["--check"]) == 1


def test_the_reference_pages_name_what_the_code_has() -> None:
    """Independent of the generator's own rendering: a few facts read back from the pages."""
    reference = REPO / "docs" / "reference"
    config = (reference / "configuration.md").read_text()
    # key, type, default, then config/cpu.yaml's value
    assert "| `max_num_seqs` | int | `64` | `32` |" in config
    assert "| `log_level` | debug \\| info \\| warning \\| error | `info` | `info` |" in config
    metrics = (reference / "metrics.md").read_text()
    assert "| `kvshare_kv_blocks` | gauge | `state` |" in metrics
    assert "| `kvshare_requests_total` | counter | `finish_reason` |" in metrics
    cli = (reference / "cli.md").read_text()
    for command in ("serve", "generate", "estimate", "healthcheck", "build-kernels"):
        assert f"## `kvshare {command}`" in cli


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    assert lines[3].startswith("make serve") and lines[4].startswith("make test"), lines[:5]


def test_the_site_loads_nothing_from_the_network(tmp_path: Path) -> None:
    """Fonts and mermaid are local: no stylesheet or script points off the site."""
    assert build(REPO, tmp_path / "site").returncode == 0
    for page in (tmp_path / "site").rglob("*.html"):
        html = page.read_text()
        assert not re.findall(r'<(?:script|link)[^>]+(?:src|href)="(?:https?:)?//', html), page
