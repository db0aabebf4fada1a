"""Schema fuzzing of kvshare, the long run: tests/integration/test_fuzz.py without its caps (a
test run for a person to start, not a benchmark: it measures nothing).

Starts `kvshare serve` (SmolLM2, the fuzzing caps of tests/integration/fuzzing.py) or uses a
running one (--url), and sends schemathesis cases from the server's own /openapi.json and from
OpenAI's openapi.yaml (chat and completions): --examples per operation and generation mode,
within --seconds per document, from --seed (random by default, so that every run explores
new cases). The checks are the test's (no 5xx; 4xx are OpenAI error envelopes naming the
field; 2xx conform to OpenAI's response schemas; the app's document describes what was sent
and answered), then the after-run check (healthy, nothing running or held, 0 leaked).

    python tests/integration/long_fuzz.py --examples 50 --seconds 600 --out fuzz.json

Prints one line per operation (requests sent, statuses, findings, refusals by field) and writes
the same as JSON. Exit status 0 when nothing was found, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx

from tests.integration.fuzzing import (
    SERVER_FLAGS,
    Fuzzer,
    OperationReport,
    app_document,
    check_after,
    openai_document,
    request_fields,
    summary,
)
from tests.integration.server import running_server


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=50, help="per operation and mode")
    parser.add_argument("--seconds", type=float, default=300.0, help="cap per document")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (random)")
    parser.add_argument("--documents", default="app,openai", help="app, openai or both")
    parser.add_argument("--url", default=None, help="a running server (else one is started)")
    parser.add_argument("--server-args", default="", help="extra `kvshare serve` flags")
    parser.add_argument("--out", type=Path, default=None, help="write the reports as JSON")
    return parser.parse_args()


def fuzz(url: str, args: argparse.Namespace, seed: int) -> tuple[list[OperationReport], list]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    fields = request_fields(url)
    reports: list[OperationReport] = []
    for kind in args.documents.split(","):
        document = app_document(url) if kind == "app" else openai_document()
        started = time.monotonic()
        reports += Fuzzer(url, model, kind, fields).run(document, args.examples, args.seconds, seed)
        print(f"{kind}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return reports, check_after(url)


def main() -> int:
    args = parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(
            running_server(*SERVER_FLAGS, *args.server_args.split())
        )
        reports, after = fuzz(url, args, seed)
    print(f"seed {seed}")
    print(summary(reports))
    for report in reports:
        if report.refused:
            top = ", ".join(f"{key} x{n}" for key, n in report.refused.most_common(8))
            print(f"  {report.label} refusals: {top}")
    print(
        "after the run: " + ("healthy, nothing held, 0 leaked" if not after else "; ".join(after))
    )
    if args.out is not None:
        record = {
            "seed": seed,
            "examples": args.examples,
            "seconds": args.seconds,
            "after": after,
            "operations": [
                {
                    "operation": r.label,
                    "requests": r.num_requests,
                    "statuses": dict(r.statuses),
                    "refused": dict(r.refused),
                    "findings": r.findings,
                    "num_findings": r.num_findings,
                }
                for r in reports
            ],
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    found = sum(r.num_findings for r in reports) + len(after)
    return 0 if found == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
