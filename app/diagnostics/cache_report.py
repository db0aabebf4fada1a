"""A tenant's cache report: where its recent prompts diverge from each other (torch-free).

Over the prompts RecentPrompts keeps for one tenant (app/diagnostics/cache.py, bounded), each
prompt is compared with the NUM_COMPARED prompts before it: its divergence offset is the
longest prefix it shares with one of them. The report gives those offsets as a histogram (by
block) and, when most prompts diverge at the same offset and agree again a little later,
the plain-language finding: the span of per-request content, with the tenant's own latest
prompt's text there as the example. Nothing outside the tenant's own window is read.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

from app.diagnostics.cache import Segment, first_difference_index, segment_at
from engine.tokenizer import Tokenizer

NUM_COMPARED = 8  # earlier prompts each prompt is compared with
REALIGN_TOKENS = 8  # equal tokens at equal positions that end a dynamic span
MIN_PROMPTS = 4


def divergence_offset(ids: Sequence[int], earlier: Sequence[Sequence[int]]) -> int:
    """The longest prefix ids shares with one of `earlier`."""
    best = 0
    for other in earlier:
        index = first_difference_index(ids, other)
        best = max(best, len(ids) if index is None else index)
    return best


def realign_index(ids: Sequence[int], other: Sequence[int], start: int) -> int | None:
    """The first position >= start from which REALIGN_TOKENS tokens agree at equal positions."""
    run = 0
    for index in range(start, min(len(ids), len(other))):
        run = run + 1 if ids[index] == other[index] else 0
        if run == REALIGN_TOKENS:
            return index - REALIGN_TOKENS + 1
    return None


def build_report(
    prompts: list[list[int]], segments: list[Segment], tokenizer: Tokenizer, block_size: int
) -> dict[str, Any]:
    """`prompts` oldest first; `segments` those of the latest prompt (its own rendering)."""
    offsets = [
        divergence_offset(ids, prompts[max(0, i - NUM_COMPARED) : i])
        for i, ids in enumerate(prompts)
        if i > 0
    ]
    histogram = Counter((offset // block_size) * block_size for offset in offsets)
    report: dict[str, Any] = {
        "num_prompts": len(prompts),
        "block_size": block_size,
        "divergence_offsets": [
            {"from_token": start, "to_token": start + block_size - 1, "prompts": count}
            for start, count in sorted(histogram.items())
        ],
        "findings": [],
    }
    finding = _dynamic_prefix_finding(prompts, offsets, segments, tokenizer)
    if finding is not None:
        report["findings"].append(finding)
    return report


def _dynamic_prefix_finding(
    prompts: list[list[int]], offsets: list[int], segments: list[Segment], tokenizer: Tokenizer
) -> dict[str, Any] | None:
    if len(offsets) + 1 < MIN_PROMPTS:
        return None
    start, count = Counter(offsets).most_common(1)[0]
    if count * 2 <= len(offsets):
        return None  # no common divergence point
    latest, previous = prompts[-1], prompts[-2]
    end = realign_index(latest, previous, start)
    if end is None or end <= start:
        return None  # they never agree again: not a span of per-request content
    segment = segment_at(segments, start) if segments else Segment(0, "prompt")
    example = tokenizer.decode(latest[start:end]).strip()
    where = "system prompt" if segment.kind == "system" else f"{segment.kind} segment"
    return {
        "kind": "dynamic_content_before_static",
        "from_token": start,
        "to_token": end - 1,
        "segment": segment.to_json(),
        "prompts": count + 1,
        "message": (
            f"the {where} carries per-request content at tokens {start}-{end - 1} "
            f"(e.g. {example!r}); move it after the static part"
        ),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as `kvshare cache-report` prints it."""
    lines = [f"{report['num_prompts']} recent prompts, {report['block_size']}-token blocks"]
    lines.append("where prompts diverge from earlier ones (token offset: prompts):")
    for row in report["divergence_offsets"]:
        lines.append(f"  {row['from_token']:>6}-{row['to_token']:<6} {row['prompts']}")
    for finding in report["findings"]:
        lines.append(f"finding: {finding['message']}")
    if not report["findings"]:
        lines.append("no finding: prompts do not share a span of per-request content")
    return "\n".join(lines)


def fetch_report(
    base_url: str, api_key: str | None, cache_salt: str | None = None, timeout_s: float = 30.0
) -> dict:
    """GET base_url/debug/cache_report, of one cache_salt's prompts (urllib: the CLI stays
    light)."""
    query = "" if cache_salt is None else "?" + urllib.parse.urlencode({"cache_salt": cache_salt})
    request = urllib.request.Request(base_url.rstrip("/") + "/debug/cache_report" + query)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())
