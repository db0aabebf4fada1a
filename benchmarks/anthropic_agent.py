"""An agent-style conversation over /v1/messages against a real `kvshare serve`: how much of
each turn's prompt the prefix cache serves, and what that does to the time to first token.

The agent sends a ~3,000-token system prompt and 20 tools every turn, forces a tool call on
even turns and answers its result on odd ones (a thinking block and a rolling cache_control
breakpoint in the history, as agents send them). Variants, each on its own server, rounds
interleaved:
  plain     no billing line;
  stripped  a billing line that changes every request, --strip-volatile-system-lines;
  kept      the same billing line, the setting off (every turn misses).
The goal (issue 52): cache_read_input_tokens / the previous prompt >= 0.95 on every turn after
the first, in `plain` and `stripped`.

    python benchmarks/anthropic_agent.py --rounds 2
    python benchmarks/anthropic_agent.py --url http://127.0.0.1:8000 --variants plain

Prints a Markdown table (medians over the rounds); exit status 1 when a turn misses the goal.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL = 0.95
NUM_TURNS = 5
TOOLS = [
    {
        "name": f"tool_{number}",
        "description": f"Tool {number} reads section {number} of the project notes.",
        "input_schema": {
            "type": "object",
            "properties": {"section": {"enum": [f"s{number}", "all"]}},
            "required": ["section"],
            "additionalProperties": False,
        },
        **({"cache_control": {"type": "ephemeral"}} if number == 19 else {}),
    }
    for number in range(20)
]
# About 3,000 tokens of instructions (SmolLM2's tokenizer), none of them volatile.
SYSTEM = "\n".join(
    f"Rule {number}: when the user asks about module {number}, read its notes first, keep "
    f"answers short, cite the file path and never change files outside the project."
    for number in range(110)
)
VARIANTS = {  # name -> (server flags, billing line in the system prompt)
    "plain": ((), False),
    "stripped": (("--strip-volatile-system-lines",), True),
    "kept": ((), True),
}


def billing_line() -> str:
    """Claude Code's attribution line, with a new hash each call (the worst case)."""
    return f"x-anthropic-billing-header: cc_version=2.1.197.{secrets.token_hex(2)[:3]};"


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    cache_read_tokens: int
    ttft_s: float
    cached_share: float | None  # cache_read / the previous turn's prompt (None: first turn)


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def run_conversation(url: str, with_billing_line: bool, num_turns: int = NUM_TURNS) -> list[Turn]:
    """num_turns turns of the agent (streamed with the SDK); every forced call's input is
    checked against its tool's schema."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    messages: list[dict] = [{"role": "user", "content": "Which section covers module 3?"}]
    turns: list[Turn] = []
    for number in range(num_turns):
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        if with_billing_line:
            system.insert(0, {"type": "text", "text": billing_line()})
        forced = number % 2 == 0
        choice = {"type": "tool", "name": f"tool_{number}"} if forced else {"type": "auto"}
        start = time.monotonic()
        ttft = None
        with client.messages.stream(
            model=model,
            max_tokens=24,
            system=system,
            tools=TOOLS,
            tool_choice=choice,
            messages=messages,
            extra_body={"temperature": 0},
        ) as stream:
            for event in stream:
                if ttft is None and event.type == "message_start":
                    ttft = time.monotonic() - start  # sent with the first token
            message = stream.get_final_message()
        previous = turns[-1].prompt_tokens if turns else None
        read = message.usage.cache_read_input_tokens
        share = None if previous is None else read / previous
        turns.append(Turn(_prompt_tokens(message.usage), read, ttft or 0.0, share))
        messages += _next_turn(message, number, forced)
        _drop_old_breakpoint(messages[-3])
    return turns


def _next_turn(message, number: int, forced: bool) -> list[dict]:
    """The assistant's turn as history, and the user's reply (a tool result, or a question)."""
    history = [block.model_dump(exclude_none=True) for block in message.content]
    if forced:
        call = history[-1]
        assert call["type"] == "tool_use" and message.stop_reason == "tool_use", message
        jsonschema.validate(call["input"], TOOLS[number]["input_schema"])
        history.insert(0, {"type": "thinking", "thinking": "Read it.", "signature": "x"})
        result = {"type": "tool_result", "tool_use_id": call["id"], "content": "Section 3."}
        reply: list[dict] = [result, {"type": "text", "text": "Go on."}]
    else:
        reply = [{"type": "text", "text": f"Now module {number}?"}]
    reply[-1]["cache_control"] = {"type": "ephemeral"}  # the rolling breakpoint
    return [{"role": "assistant", "content": history}, {"role": "user", "content": reply}]


def _drop_old_breakpoint(message: dict) -> None:
    if isinstance(message["content"], list):
        for block in message["content"]:
            block.pop("cache_control", None)


def _table(results: dict[str, list[list[Turn]]]) -> str:
    lines = [
        "| variant | turn | prompt tokens | cache_read | share of previous prompt | TTFT ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, rounds in results.items():
        for number in range(len(rounds[0])):
            turns = [one[number] for one in rounds]
            shares = [t.cached_share for t in turns if t.cached_share is not None]
            share = f"{statistics.median(shares):.3f}" if shares else "-"
            lines.append(
                f"| {name} | {number + 1} | {turns[0].prompt_tokens} "
                f"| {statistics.median(t.cache_read_tokens for t in turns):.0f} | {share} "
                f"| {1000 * statistics.median(t.ttft_s for t in turns):.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (else one per variant is started)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--server-args", default="", help="extra flags for started servers")
    args = parser.parse_args(argv)
    results: dict[str, list[list[Turn]]] = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            flags, billing = VARIANTS[name]
            results[name].append(_run_variant(args, flags, billing))
    print(_table(results))
    met = all(
        t.cached_share is None or t.cached_share >= GOAL
        for name in ("plain", "stripped")
        for rounds in results.get(name, [])
        for t in rounds
    )
    print(f"\ngoal (share >= {GOAL} from turn 2, plain and stripped): {'met' if met else 'MISSED'}")
    return 0 if met else 1


def _run_variant(args, flags: tuple[str, ...], billing: bool) -> list[Turn]:
    if args.url:
        return run_conversation(args.url, billing)
    from benchmarks.servers import running_kvshare

    with running_kvshare(*flags, *args.server_args.split()) as url:
        return run_conversation(url, billing)


if __name__ == "__main__":
    sys.exit(main())
