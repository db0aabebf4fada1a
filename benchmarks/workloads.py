"""The serving benchmark's workloads: deterministic conversations, users' think times and
Poisson arrivals (benchmarks/serving.py sends them).

Prompts are built from a small English vocabulary, about one token per word with a BPE
tokenizer; a nonce opens every prompt that must share nothing beyond the chat template.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("shared-prefix", "multi-turn", "unique", "mixed-length", "many-system-prompts")
# About one token per common English word with a BPE tokenizer: ~200 tokens of system prompt.
SHARED_PREFIX_WORDS = 190
QUESTION_WORDS = 12
TURNS_PER_CONVERSATION = 4
CONTEXT_WORDS = 60  # a multi-turn conversation's opening context
MIXED_MIN_PROMPT_WORDS = 16
MIXED_MAX_PROMPT_WORDS = 768
NUM_SYSTEM_PROMPTS = 8  # many-system-prompts: distinct ~200-token system prompts

_VOCABULARY = (
    "the system answers every question about orders shipping returns and payments with care "
    "customer account invoice refund warehouse delivery address package tracking number "
    "policy product price discount coupon member support agent ticket priority email phone "
    "window days business weekend holiday region country currency tax receipt label carrier "
    "damaged missing late early exchange replacement warranty repair battery screen cable "
    "charger laptop tablet camera speaker kitchen garden office chair table lamp blanket "
    "always never politely briefly clearly first then finally before after because unless "
    "check confirm explain apologize escalate verify update cancel schedule compare include"
)
_WORDS = _VOCABULARY.split()


@dataclass
class Conversation:
    """User turns sent one after another; each turn resends the history and the answers so far."""

    conversation_id: int
    user_turns: list[str]
    max_tokens: list[int]  # one per turn
    system_prompt: str | None = None


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _nonce(rng: random.Random) -> str:
    # A distinct opening so that unrelated prompts share no prefix beyond the chat template.
    return f"[{rng.randrange(10**9):09d}]"


def _question(rng: random.Random, index: int) -> str:
    return f"Question {index}: {_words(rng, QUESTION_WORDS)}?"


def build_workload(name: str, num_requests: int, max_tokens: int, seed: int) -> list[Conversation]:
    """Deterministic conversations for a workload; their turns add up to exactly num_requests.

    shared-prefix: one ~200-token system prompt for all, a short different question each.
    multi-turn:    4-turn conversations (the last one may be shorter), each opening with its own
                   context; every turn resends the history with the answers appended.
    unique:        prompts as long as the shared-prefix ones but sharing nothing.
    mixed-length:  unique prompts of log-uniform length, max_tokens in [max_tokens/8, max_tokens].
    many-system-prompts: 8 distinct ~200-token system prompts, each shared by several users
                   (request i uses prompt i % 8) in a shuffled order, a different question each.
    """
    if num_requests < 1 or max_tokens < 1:
        raise ValueError("num_requests and max_tokens must be at least 1")
    rng = random.Random(seed)
    if name == "shared-prefix":
        system = f"You are a support assistant. {_words(rng, SHARED_PREFIX_WORDS)}."
        return [
            Conversation(i, [_question(rng, i)], [max_tokens], system) for i in range(num_requests)
        ]
    if name == "multi-turn":
        return _multi_turn(rng, num_requests, max_tokens)
    if name == "unique":
        return [_unique(rng, i, max_tokens) for i in range(num_requests)]
    if name == "mixed-length":
        return [_mixed_length(rng, i, max_tokens) for i in range(num_requests)]
    if name == "many-system-prompts":
        return _many_system_prompts(rng, num_requests, max_tokens)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def _multi_turn(rng: random.Random, num_requests: int, max_tokens: int) -> list[Conversation]:
    firsts = range(0, num_requests, TURNS_PER_CONVERSATION)
    return [
        _conversation(rng, i, min(TURNS_PER_CONVERSATION, num_requests - first), max_tokens)
        for i, first in enumerate(firsts)
    ]


def long_conversations(
    num_conversations: int, num_turns: int, max_tokens: int, seed: int, context_words: int
) -> list[Conversation]:
    """multi-turn's conversations with num_turns turns each and an opening context of
    context_words words (benchmarks/kv_tier.py sizes its working set with them)."""
    if min(num_conversations, num_turns, max_tokens, context_words) < 1:
        raise ValueError("every count must be at least 1")
    rng = random.Random(seed)
    return [
        _conversation(rng, conversation_id, num_turns, max_tokens, context_words)
        for conversation_id in range(num_conversations)
    ]


def _conversation(
    rng: random.Random,
    conversation_id: int,
    num_turns: int,
    max_tokens: int,
    context_words: int = CONTEXT_WORDS,
) -> Conversation:
    opening = f"{_nonce(rng)} Context: {_words(rng, context_words)}. {_question(rng, 0)}"
    turns = [opening] + [_question(rng, t) for t in range(1, num_turns)]
    return Conversation(conversation_id, turns, [max_tokens] * num_turns)


def _many_system_prompts(
    rng: random.Random, num_requests: int, max_tokens: int
) -> list[Conversation]:
    systems = [
        f"{_nonce(rng)} You are support assistant {k}. {_words(rng, SHARED_PREFIX_WORDS)}."
        for k in range(NUM_SYSTEM_PROMPTS)
    ]
    # Shuffled, so that a router that simply alternates does not keep each prompt on one
    # replica by accident of the arrival order.
    order = list(range(num_requests))
    rng.shuffle(order)
    return [
        Conversation(i, [_question(rng, i)], [max_tokens], systems[i % NUM_SYSTEM_PROMPTS])
        for i in order
    ]


def _unique(rng: random.Random, index: int, max_tokens: int) -> Conversation:
    prompt = f"{_nonce(rng)} {_words(rng, SHARED_PREFIX_WORDS + QUESTION_WORDS)}?"
    return Conversation(index, [prompt], [max_tokens])


def _mixed_length(rng: random.Random, index: int, max_tokens: int) -> Conversation:
    log_low, log_high = math.log(MIXED_MIN_PROMPT_WORDS), math.log(MIXED_MAX_PROMPT_WORDS)
    num_words = round(math.exp(rng.uniform(log_low, log_high)))
    num_tokens = rng.randint(max(1, max_tokens // 8), max_tokens)
    return Conversation(index, [f"{_nonce(rng)} {_words(rng, num_words)}?"], [num_tokens])


def think_times(num_pauses: int, mean_s: float, seed: int, conversation_id: int) -> list[float]:
    """A user's pauses in seconds between reading an answer and sending the next turn (one
    per later turn): exponential with mean mean_s (all 0 at mean 0), per conversation and seed."""
    if mean_s < 0:
        raise ValueError("mean_s must not be negative")
    if mean_s == 0:
        return [0.0] * num_pauses
    rng = random.Random(f"think-{seed}-{conversation_id}")
    return [rng.expovariate(1.0 / mean_s) for _ in range(num_pauses)]


def arrival_delays(num_arrivals: int, request_rate: float, seed: int) -> list[float]:
    """Gaps in seconds before each arrival: exponential (a Poisson process), all 0 at rate inf."""
    if request_rate <= 0:
        raise ValueError("request_rate must be positive")
    if math.isinf(request_rate):
        return [0.0] * num_arrivals
    rng = random.Random(seed + 1)  # its own stream: the prompts do not depend on the rate
    return [rng.expovariate(request_rate) for _ in range(num_arrivals)]
