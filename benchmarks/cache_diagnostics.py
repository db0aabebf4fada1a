"""The design's experiment: per-request content before the static system prompt, then after.

It starts `kvshare serve` (the embedded SmolLM2) and sends N chat requests whose system prompt
starts with a timestamp and a request id, then the same N requests with that dynamic part
moved after the static part. Every request asks for `cache_diagnostics`; max_tokens is 1 (the
prefill is what the cache saves). Prints, per run, the hit rate (cached / prompt tokens, from
usage), the reasons the responses gave, and where the first unmatched token fell (segment and
token offsets), and the miss-reason counters of /metrics after both runs.

    python benchmarks/cache_diagnostics.py --num-requests 50 \
        --out benchmarks/results/cache_diagnostics.json

Goal (the issue): hit rate under 10% before, at least 70% after; the first run's diagnostics
point at the timestamp's tokens in the system segment.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.servers import running_kvshare, scrape

STATIC = (
    "You are the support assistant of Northwind Outfitters, a shop for hiking and camping "
    "gear. Answer in two sentences at most. Be friendly and precise. Never invent prices: "
    "if you do not know one, say that the customer should check the product page. Our "
    "return policy: unused items within 30 days, with the receipt; sale items are final. "
    "Shipping is free over 50 euros and takes three to five working days inside the EU. "
    "Orders placed before noon leave the warehouse the same day. Customers outside the EU pay "
    "import duties themselves; we cannot estimate them. Gift cards never expire and cannot be "
    "exchanged for cash. For a damaged delivery, ask for photos of the parcel and the item, "
    "then open a claim with the carrier; we send a replacement once the claim is filed. "
    "Our stores in Hamburg, Lyon and Turin open from 10:00 to 19:00, Monday to Saturday."
)
QUESTIONS = ("Can I return a tent I used once?", "How long does shipping take to Spain?")


def dynamic_part(index: int, rng: random.Random) -> str:
    second = 7 + index
    request_id = "".join(rng.choice("0123456789abcdef") for _ in range(12))
    return f"Current time: 2026-12-01 20:41:{second:02d}. Request id: {request_id}."


def messages(index: int, rng: random.Random, dynamic_first: bool) -> list[dict]:
    dynamic = dynamic_part(index, rng)
    system = f"{dynamic}\n{STATIC}" if dynamic_first else f"{STATIC}\n{dynamic}"
    question = QUESTIONS[index % len(QUESTIONS)]
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def run_phase(client: openai.OpenAI, num_requests: int, dynamic_first: bool, salt: str) -> dict:
    rng = random.Random(0)
    num_prompt = num_cached = 0
    reasons: Counter[str] = Counter()
    points: Counter[tuple] = Counter()
    examples = []
    for index in range(num_requests):
        response = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=messages(index, rng, dynamic_first),
            max_tokens=1,
            temperature=0.0,
            extra_body={"cache_diagnostics": True, "cache_salt": salt},
        )
        usage = response.usage
        num_prompt += usage.prompt_tokens
        num_cached += usage.prompt_tokens_details.cached_tokens
        diagnostics = response.model_extra["cache_diagnostics"]
        reasons[diagnostics["reason"]] += 1
        segment = diagnostics.get("segment", {}).get("kind")
        points[(segment, diagnostics["first_miss_index"])] += 1
        if index in (1, num_requests - 1):
            examples.append(diagnostics)
    return {
        "dynamic_first": dynamic_first,
        "num_requests": num_requests,
        "prompt_tokens": num_prompt,
        "cached_tokens": num_cached,
        "hit_rate": num_cached / num_prompt,
        "reasons": dict(reasons),
        "first_miss": [[seg, idx, n] for (seg, idx), n in points.most_common()],
        "examples": examples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--server-args", default="--num-threads 1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with running_kvshare(*args.server_args.split()) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
        phases = [
            run_phase(client, args.num_requests, dynamic_first=True, salt="before"),
            run_phase(client, args.num_requests, dynamic_first=False, salt="after"),
        ]
        metrics = scrape(base_url)
    misses = {k: v for k, v in metrics.items() if k.startswith("kvshare_prefix_cache_miss")}
    print("| system prompt | requests | prompt tokens | cached | hit rate | reasons |")
    print("|---|---|---|---|---|---|")
    for phase in phases:
        where = "dynamic first" if phase["dynamic_first"] else "dynamic last"
        print(
            f"| {where} | {phase['num_requests']} | {phase['prompt_tokens']} | "
            f"{phase['cached_tokens']} | {phase['hit_rate']:.1%} | {phase['reasons']} |"
        )
    for phase in phases:
        print("first miss (segment, token index, requests):", phase["first_miss"][:4])
    print("example diagnostics (first run):", json.dumps(phases[0]["examples"][0]))
    print("miss tokens by reason:", misses)
    if args.out:
        args.out.write_text(json.dumps({"phases": phases, "metrics": misses}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
