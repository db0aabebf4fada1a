"""benchmarks/kv_tier.py's engines and requests: the served configuration with a pool size and a
tier, requests served one at a time offline with their TTFT and cache figures, conversations
through the chat template."""

from __future__ import annotations

import dataclasses
import itertools
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.workloads import Conversation
from engine.core.config import EngineConfig
from engine.core.protocol import EngineRequest, EngineStats
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parent.parent
_request_ids = itertools.count()


def served_config(**overrides: object) -> EngineConfig:
    """config/cpu.yaml's engine settings (what `make serve` runs) with `overrides`."""
    from app.settings import load_settings

    config = load_settings(REPO / "config" / "cpu.yaml", environ={}).to_engine_config()
    return dataclasses.replace(config, **overrides)


def build_engine(kv_tier: str, num_kv_blocks: int, tier_dir: str | None, **overrides: object):
    """An engine of the served config with this pool and tier (disk: in tier_dir)."""
    return LLMEngine(
        served_config(
            num_kv_blocks=num_kv_blocks, kv_tier=kv_tier, kv_tier_dir=tier_dir, **overrides
        )
    )


@contextmanager
def running_engine(kv_tier: str, num_kv_blocks: int, **overrides: object) -> Iterator[LLMEngine]:
    """build_engine() on a fresh temporary tier directory; closed, directory removed, after."""
    with tempfile.TemporaryDirectory(prefix="kvshare-tier-") as tier_dir:
        engine = build_engine(kv_tier, num_kv_blocks, tier_dir, **overrides)
        try:
            yield engine
        finally:
            engine.close()


@dataclass
class Served:
    """One request served alone: its TTFT and what its admission took from the caches."""

    ttft_s: float
    output_ids: list[int]
    num_prompt_tokens: int
    num_queried_tokens: int  # prefix_cache_queries of its admission
    num_hit_tokens: int  # prefix_cache_hits, pool and tier
    num_tier_hit_tokens: int  # prefix_cache_tier_hits
    tier_load_s: float  # the tier loads' seconds while it ran
    num_detected: int  # tier entries that failed verification (checksum, refused) meanwhile
    num_restore_audits: int
    step_s: list[float] = field(default_factory=list)  # its steps up to the first token


def serve(
    engine: LLMEngine,
    prompt: Sequence[int],
    max_tokens: int,
    cache_salt: str | None = None,
) -> Served:
    """Add one greedy request and step the engine until it (and its audits) finish."""
    before = engine.stats()
    request_id = f"kv-tier-{next(_request_ids)}"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    started = time.perf_counter()
    engine.add_request(EngineRequest(request_id, list(prompt), params, cache_salt=cache_salt))
    ttft_s, output_ids, load_s, step_s = None, [], 0.0, []
    while engine.has_unfinished_requests():
        is_first_pending = ttft_s is None
        step_started = time.perf_counter()
        for output in engine.step():
            assert output.error is None, output.error
            for choice in output.outputs:
                output_ids.extend(choice.new_token_ids)
            if ttft_s is None and (output_ids or output.finished):
                ttft_s = time.perf_counter() - started
        if is_first_pending:
            step_s.append(time.perf_counter() - step_started)
        load_s += sum(engine.stats().tier_load_seconds)
    return _served(before, engine.stats(), ttft_s or 0.0, output_ids, len(prompt), load_s, step_s)


def _served(
    before: EngineStats,
    after: EngineStats,
    ttft_s: float,
    output_ids: list[int],
    num_prompt_tokens: int,
    load_s: float,
    step_s: list[float],
) -> Served:
    def grew(name: str) -> int:
        return getattr(after, name) - getattr(before, name)

    return Served(
        ttft_s=ttft_s,
        output_ids=output_ids,
        num_prompt_tokens=num_prompt_tokens,
        num_queried_tokens=grew("prefix_cache_queries"),
        num_hit_tokens=grew("prefix_cache_hits"),
        num_tier_hit_tokens=grew("prefix_cache_tier_hits"),
        tier_load_s=load_s,
        num_detected=grew("num_tier_checksum_failures") + grew("num_tier_refused_entries"),
        num_restore_audits=grew("num_restore_audits"),
        step_s=step_s,
    )


def hit_rate(served: Sequence[Served]) -> float:
    """prefix_cache_hits / prefix_cache_queries over these requests."""
    queried = sum(s.num_queried_tokens for s in served)
    return sum(s.num_hit_tokens for s in served) / queried if queried else 0.0


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    """Token ids no other prompt shares (ordinary vocabulary ids)."""
    return [rng.randrange(1000, 40000) for _ in range(num_tokens)]


def push_out(engine: LLMEngine, num_tokens: int, piece_tokens: int, rng: random.Random) -> None:
    """Compute unique prompts (max_tokens 0: scored and cached, nothing generated) of
    num_tokens together, piece_tokens at most each: every block cached before is evicted from
    a pool of fewer blocks (least recently used first)."""
    while num_tokens > 0:
        piece = min(piece_tokens, num_tokens)
        serve(engine, random_prompt(rng, piece), max_tokens=0)
        num_tokens -= piece


def distinct_blocks(sequences: Sequence[Sequence[int]], block_size: int) -> int:
    """Full blocks of these token sequences, each token path from position 0 counted once:
    what a prefix cache without a size limit would hold after them."""
    paths = set()
    for tokens in sequences:
        key = 0
        for start in range(0, len(tokens) - block_size + 1, block_size):
            key = hash((key, tuple(tokens[start : start + block_size])))
            paths.add(key)
    return len(paths)


class Chats:
    """Conversations through the chat template: each turn's prompt is the history (the user
    turns and the answers so far) with the next user turn."""

    def __init__(self, tokenizer, conversations: list[Conversation]) -> None:
        self.tokenizer = tokenizer
        self.conversations = conversations
        self.histories: list[list[dict[str, str]]] = [[] for _ in conversations]
        self.sequences: list[list[int]] = []  # every request's prompt and output ids

    def prompt(self, index: int, turn: int) -> list[int]:
        user = {"role": "user", "content": self.conversations[index].user_turns[turn]}
        encoded = self.tokenizer.apply_chat_template(
            [*self.histories[index], user],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def answer(self, index: int, turn: int, prompt: list[int], output_ids: list[int]) -> None:
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        user = {"role": "user", "content": self.conversations[index].user_turns[turn]}
        self.histories[index] += [user, {"role": "assistant", "content": text}]
        self.sequences.append(prompt + output_ids)

    def run(self, engine: LLMEngine, turns: Sequence[int]) -> list[Served]:
        """These turns of every conversation, one request at a time: every conversation's
        turn t before any conversation's turn t + 1 (users taking turns)."""
        served = []
        for turn in turns:
            for index, conversation in enumerate(self.conversations):
                prompt = self.prompt(index, turn)
                one = serve(engine, prompt, conversation.max_tokens[turn])
                self.answer(index, turn, prompt, one.output_ids)
                served.append(one)
        return served
