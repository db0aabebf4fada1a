"""Triton's interpreter for a test file: claim it before triton loads, or rerun the file in a
fresh process that has it.

triton.jit picks the interpreter when it decorates (triton's own library included), so
TRITON_INTERPRET=1 works only if set before triton is imported. A file that finds triton
already loaded compiled must not set the variable: later files trust it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def claim_interpreter() -> bool:
    """Whether this process can interpret Triton kernels; sets TRITON_INTERPRET=1 where so."""
    can = "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
    if can:
        os.environ["TRITON_INTERPRET"] = "1"
    return can


def run_in_fresh_process(test_file: str) -> None:
    """Run `test_file` under pytest with TRITON_INTERPRET=1; assert it passes."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
