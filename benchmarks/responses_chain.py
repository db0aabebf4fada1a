"""A conversation chained over previous_response_id against a real `kvshare serve`: how much of
each turn's prompt the prefix cache serves.

Each turn sends only its new question and the previous response's id; the server rebuilds the
conversation from its store and starts the prompt with the previous turn's own prompt and
output tokens, so the blocks the previous turn left in the radix tree match. The goal (issue
23): from turn 2 on, cached_tokens >= 90% of the previous turn's input + output tokens.

    python benchmarks/responses_chain.py --turns 4 --server-args "--num-threads 1"
    python benchmarks/responses_chain.py --url http://127.0.0.1:8000   # a running server

Prints a Markdown table; exit status 1 when a turn misses the goal.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.servers import running_kvshare

GOAL = 0.9
QUESTIONS = (
    "I am planning a small vegetable garden behind my house. The soil is heavy clay, the spot "
    "gets about six hours of sun a day, and I have never grown anything before. What should I "
    "plant in the first year, and how should I prepare the ground?",
    "Thanks. Which of those vegetables can I start from seed indoors, and when should I move "
    "the seedlings outside if the last frost here is usually in the middle of April?",
    "How often should I water them during a hot and dry summer, and is it better to water in "
    "the morning or in the evening? I will be away for a week in July.",
    "Finally, what can I do in the autumn so that the clay soil is easier to work next spring, "
    "and should I grow anything over the winter?",
)


@dataclass(frozen=True)
class TurnFigures:
    turn: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    previous_tokens: int  # the previous turn's input + output tokens (0 on the first turn)

    @property
    def cached_fraction(self) -> float | None:
        """cached_tokens / previous_tokens: the share of the previous turn the cache served."""
        return self.cached_tokens / self.previous_tokens if self.previous_tokens else None


def run_chain(
    base_url: str,
    model: str,
    questions: tuple[str, ...] = QUESTIONS,
    max_output_tokens: int = 64,
    headers: dict[str, str] | None = None,
) -> list[TurnFigures]:
    """Send each question chained to the previous response; the figures of every turn."""
    figures: list[TurnFigures] = []
    previous_id, previous_tokens = None, 0
    with httpx.Client(base_url=base_url, timeout=300, headers=headers) as http:
        for turn, question in enumerate(questions, start=1):
            body = {
                "model": model,
                "input": question,
                "max_output_tokens": max_output_tokens,
                "temperature": 0,
                "previous_response_id": previous_id,
            }
            response = http.post("/v1/responses", json=body)
            response.raise_for_status()
            data = response.json()
            usage = data["usage"]
            cached = usage["input_tokens_details"]["cached_tokens"]
            output_tokens = usage["output_tokens"]
            figures.append(
                TurnFigures(turn, usage["input_tokens"], cached, output_tokens, previous_tokens)
            )
            previous_id = data["id"]
            previous_tokens = usage["input_tokens"] + output_tokens
    return figures


def table(figures: list[TurnFigures]) -> str:
    lines = [
        "| turn | input tokens | cached tokens | output tokens | previous input + output "
        "| cached / previous |",
        "|---|---|---|---|---|---|",
    ]
    for f in figures:
        fraction = "-" if f.cached_fraction is None else f"{f.cached_fraction:.3f}"
        lines.append(
            f"| {f.turn} | {f.input_tokens} | {f.cached_tokens} | {f.output_tokens} "
            f"| {f.previous_tokens or '-'} | {fraction} |"
        )
    return "\n".join(lines)


def meets_goal(figures: list[TurnFigures]) -> bool:
    return all(f.cached_fraction >= GOAL for f in figures if f.cached_fraction is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--url", help="a running server (else one is started)")
    parser.add_argument("--server-args", default="", help="flags for the started server")
    args = parser.parse_args(argv)
    questions = tuple(QUESTIONS[i % len(QUESTIONS)] for i in range(args.turns))
    if args.url:
        figures = _measure(args.url, questions, args.max_output_tokens)
    else:
        with running_kvshare(*shlex.split(args.server_args)) as url:
            figures = _measure(url, questions, args.max_output_tokens)
    print(table(figures))
    return 0 if meets_goal(figures) else 1


def _measure(url: str, questions: tuple[str, ...], max_output_tokens: int) -> list[TurnFigures]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    return run_chain(url, model, questions, max_output_tokens)


if __name__ == "__main__":
    raise SystemExit(main())
