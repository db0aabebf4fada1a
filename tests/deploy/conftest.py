"""benchmarks/ and tests/deploy/promql.py are imported by path from the repository root."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    # benchmarks/ is a folder of scripts, not an installed package.
    sys.path.insert(0, str(REPO_ROOT))
