"""What the Responses event stream costs next to a chat completions stream of the same answer.

It starts `kvshare serve` (the embedded SmolLM2) and sends the same seeded questions through
`POST /v1/chat/completions` (stream) and `POST /v1/responses` (stream), one at a time,
alternating, after a warm-up of each. Per route: time to the first text delta, the whole
answer's time, and bytes on the wire per output token. The text must be the same on both.

    python benchmarks/responses_stream.py --rounds 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.servers import running_kvshare

QUESTIONS = [
    "Write a haiku about the sea.",
    "Name three colours of the rainbow.",
    "What is the capital of France?",
    "Give me a tip for learning to cook.",
]


def _data_lines(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def _chat(http: httpx.Client, model: str, question: str, seed: int, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _measure(http, "/v1/chat/completions", body, _chat_text, _chat_tokens)


def _chat_text(chunk: dict) -> str:
    return "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))


def _chat_tokens(chunk: dict) -> int | None:
    usage = chunk.get("usage")
    return usage["completion_tokens"] if usage else None


def _responses(http: httpx.Client, model: str, question: str, seed: int, max_tokens: int):
    body = {"model": model, "input": question, "max_output_tokens": max_tokens, "seed": seed}
    return _measure(http, "/v1/responses", {**body, "stream": True}, _event_text, _event_tokens)


def _event_text(event: dict) -> str:
    return event["delta"] if event["type"] == "response.output_text.delta" else ""


def _event_tokens(event: dict) -> int | None:
    usage = event.get("response", {}).get("usage")
    return usage["output_tokens"] if usage and event["type"] != "response.in_progress" else None


def _measure(http, path, body, text_of, tokens_of) -> dict:
    start = time.perf_counter()
    first, text, num_tokens, num_bytes = None, "", 0, 0
    with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for item in _data_lines(response):
            piece = text_of(item)
            if piece and first is None:
                first = time.perf_counter() - start
            text += piece
            num_tokens = tokens_of(item) or num_tokens
        num_bytes = response.num_bytes_downloaded
    total = time.perf_counter() - start
    return {
        "ttft_s": first,
        "total_s": total,
        "text": text,
        "tokens": num_tokens,
        "bytes": num_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"chat": [], "responses": []}
    with running_kvshare() as url, httpx.Client(base_url=url, timeout=300) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for route in (_chat, _responses):  # warm-up
            route(http, model, "Hi", 0, 16)
        for number in range(args.rounds):
            question = QUESTIONS[number % len(QUESTIONS)]
            chat = _chat(http, model, question, number, args.max_tokens)
            events = _responses(http, model, question, number, args.max_tokens)
            assert chat["text"] == events["text"], (chat["text"], events["text"])
            runs["chat"].append(chat)
            runs["responses"].append(events)
            print(f"round {number}: {chat['tokens']} tokens", file=sys.stderr, flush=True)
    for name, samples in runs.items():
        ttft = statistics.median(s["ttft_s"] for s in samples)
        total = statistics.median(s["total_s"] for s in samples)
        per_token = sum(s["bytes"] for s in samples) / sum(s["tokens"] for s in samples)
        print(
            f"{name:9s} TTFT p50 {ttft * 1000:.0f} ms, total p50 {total * 1000:.0f} ms, "
            f"{per_token:.0f} bytes per output token ({len(samples)} answers)"
        )


if __name__ == "__main__":
    main()
