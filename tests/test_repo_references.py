"""No file in the repository points outside it: a fresh clone is all a reader or CI gets."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Built from parts so that this file does not match itself.
OUTSIDE = ("/" + "work/", ".." + "/shared", "DESIGN" + ".md")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".json", ".cfg", ""}


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [REPO / name for name in listed if (REPO / name).suffix in TEXT_SUFFIXES]


def test_no_file_names_a_path_outside_the_repository():
    files = tracked_files()
    assert any(path.name == "README.md" for path in files)  # the listing found the tree
    found = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(REPO)}: {word}" for word in OUTSIDE if word in text]
    assert not found, found
