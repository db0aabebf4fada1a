"""Frozen, validated sampling parameters (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.errors import ParamError
from engine.core.seeds import MAX_SEED


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


STRUCTURED_KINDS = ("json_object", "json_schema", "tool_calls")
_KINDS_WITH_SCHEMA = ("json_schema", "tool_calls")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the text a request may generate, enforced by a grammar in the engine.

    kind "json_object": any JSON object; "json_schema": JSON that conforms to `schema`, the
    schema as canonical JSON text (no spaces, keys sorted except the property names under each
    `properties`, which keep the client's order, the order the grammar writes them in: equal
    schemas are equal strings, so compiled grammars are cached by it). The edge
    (app/openai/structured_output.py) has already checked the schema and refused keywords the
    grammar engine would ignore.

    kind "tool_calls" (tool_choice "auto"): free text in which every `<tool_call>` starts a
    call that must be completed as `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`
    with ARGS conforming to that function's parameters; `schema` is the canonical JSON of
    the list `[{"name": NAME, "parameters": SCHEMA}, ...]`.
    """

    kind: str
    schema: str | None = None
    # The request field an error about this constraint names; not part of the grammar's key.
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            "response_format",
            f"response_format type must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind}",
        )
        _check(
            (self.kind in _KINDS_WITH_SCHEMA) == (self.schema is not None),
            "response_format",
            f"a {self.kind} constraint "
            + ("needs a schema" if self.kind in _KINDS_WITH_SCHEMA else "takes no schema"),
        )


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `temperature == 0` means greedy.

    `logprobs` is None for no logprobs, else the number of top alternatives (0..20) to
    return beside the sampled token's own logprob. `prompt_logprobs` (echo with logprobs)
    is the same for every prompt token but the first: its logprob under the logits of the
    position before it; a request that asks reuses no cached KV (cached positions have no
    logits). `max_tokens == 0` computes (and caches) the prompt and generates nothing: a
    scoring request. `stop` strings are matched on text by the detokenizer
    (engine/tokenizer.py), not by the scheduler.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # grammar-constrained output (None: free text)

    def __post_init__(self) -> None:
        _check(self.n >= 1, "n", f"n must be >= 1, got {self.n}")
        _check(
            self.max_tokens >= 0, "max_tokens", f"max_tokens must be >= 0, got {self.max_tokens}"
        )
        _check(
            self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"
        )
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be >= 0, got {self.temperature}",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k == -1 or self.top_k >= 1,
            "top_k",
            f"top_k must be -1 (off) or >= 1, got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        for token_id, bias in self.logit_bias.items():
            _check(
                -100.0 <= bias <= 100.0,
                "logit_bias",
                f"logit_bias for token {token_id} must be in [-100, 100], got {bias}",
            )
        _check(
            self.seed is None or 0 <= self.seed <= MAX_SEED,
            "seed",
            f"seed must be in [0, 2**63 - 1], got {self.seed}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
        )
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ParamError if a token id field names a token outside the vocabulary."""
        for token_id in self.logit_bias:
            _check(
                0 <= token_id < vocab_size,
                "logit_bias",
                f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
            )
        for token_id in self.stop_token_ids:
            _check(
                0 <= token_id < vocab_size,
                "stop_token_ids",
                f"stop_token_ids token id {token_id} is outside the vocabulary [0, {vocab_size})",
            )
