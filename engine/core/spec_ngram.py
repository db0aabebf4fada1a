"""N-gram prompt lookup: draft tokens for speculative decoding, taken from the context (torch-free).

A decoding sequence's last n tokens (n from max_n down to min_n) are looked up earlier in its
own tokens (prompt and outputs); the k tokens that followed the latest earlier occurrence
are the draft. The target model then computes the last token and the draft in one forward,
with logits at each of those 1 + k positions (engine/runtime/model_runner.py); the scheduler
keeps the longest prefix of the draft that equals the target's own choices, plus the target's
choice after it (update_from_output).

Exactness: the choice at each position is drawn by the ordinary sampler with that position's
output index t, and the draw for index t is a pure function of (seed, t) (invariant 4), so
every kept token is the one decoding without speculation would produce, greedy or sampled.
Only grammar-constrained requests are never drafted (their matchers advance one token a step).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace

from engine.core.batch import SampledToken, SampleSpec
from engine.core.protocol import CompletionOutput

_ITEM = array("i").itemsize  # bytes per token id in the search buffer


@dataclass(frozen=True)
class NgramProposer:
    """num_tokens: the most draft tokens per step (k); min_n..max_n: match lengths tried."""

    num_tokens: int
    min_n: int = 1
    max_n: int = 4

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """Up to min(num_tokens, max_num_tokens) tokens that followed the longest suffix of
        token_ids (min_n..max_n tokens) at its latest earlier occurrence; [] if none."""
        return self.propose_in(search_bytes(token_ids), max_num_tokens)

    def propose_in(self, haystack: bytes, max_num_tokens: int) -> list[int]:
        """propose() over the tokens already encoded by search_bytes() (a sequence keeps its
        prompt's encoding, so a step encodes only the outputs)."""
        num_ids = len(haystack) // _ITEM
        limit = min(self.num_tokens, max_num_tokens)
        if limit <= 0 or num_ids <= self.min_n:
            return []
        for n in range(min(self.max_n, num_ids - 1), self.min_n - 1, -1):
            start = _latest_earlier_match(haystack, haystack[-n * _ITEM :], num_ids - n)
            if start is not None:
                begin = (start + n) * _ITEM
                draft = array("i", haystack[begin : begin + limit * _ITEM]).tolist()
                if draft:
                    return draft
        return []


def search_bytes(token_ids: list[int]) -> bytes:
    """Token ids as the search text: bytes.rfind searches in C, which beats a Python scan per
    position."""
    return array("i", token_ids).tobytes()


def _latest_earlier_match(haystack: bytes, needle: bytes, end: int) -> int | None:
    """The latest token position p < end where the n tokens of `needle` occur."""
    stop = end * _ITEM - _ITEM + len(needle)  # the match must start before `end`
    while stop > 0:
        found = haystack.rfind(needle, 0, stop)
        if found < 0:
            return None
        if found % _ITEM == 0:  # aligned on a token, not inside one
            return found // _ITEM
        stop = found + len(needle) - 1
    return None


def verify_specs(spec: SampleSpec, draft: list[int]) -> list[SampleSpec]:
    """The SampleSpec of each of the 1 + len(draft) verified positions: position j draws output
    index t + j with the history it would have if the draft's first j tokens were kept."""
    return [
        replace(
            spec,
            output_index=spec.output_index + j,
            output_token_ids=spec.output_token_ids + draft[:j] if j else spec.output_token_ids,
        )
        for j in range(len(draft) + 1)
    ]


def num_accepted(draft: list[int], chosen: list[SampledToken]) -> int:
    """How many leading draft tokens equal the target's choices at their positions."""
    for j, token_id in enumerate(draft):
        if chosen[j].token_id != token_id:
            return j
    return len(draft)


def merge_completions(parts: list[CompletionOutput]) -> CompletionOutput:
    """One delta for the tokens a verified step kept, in order (the last one may finish)."""
    last = parts[-1]
    logprobs = [lp for part in parts for lp in part.new_logprobs or []]
    return CompletionOutput(
        index=last.index,
        new_token_ids=[t for part in parts for t in part.new_token_ids],
        new_logprobs=logprobs if last.new_logprobs is not None else None,
        finish_reason=last.finish_reason,
        stop_token_id=last.stop_token_id,
    )
