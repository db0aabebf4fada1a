"""Token sampling with counter-based randomness: the draw is a pure function of (seed, t).

Order per row: grammar mask (structured output: tokens the choice's grammar forbids get
-inf) -> logit_bias -> min_tokens (EOS/stop ids banned) -> repetition penalty (HF: prompt +
output) -> presence/frequency penalties (OpenAI: output only) -> greedy argmax, or
temperature -> top_k -> top_p -> min_p -> sample. Logprobs come from the raw logits (before
any of that, the grammar mask included: they say what the model thought, not what the
grammar let through).

Sampling uses the exponential race: argmax_v p[v] / E[v] with E[v] = -log u[v] is an exact
draw from p, and u[v] = hash(seed, t, v) needs no generator state, so no other row, step or
batch order can change a seeded row's token. Every stage is vectorised over rows. On CUDA
the one host sync is the final .tolist() (Drawn.result(): a lookahead step is queued before
it, reading the ids on the device); on the CPU, where syncs cost nothing, top_p also
checks whether its candidate set (a top-k, far cheaper than a full sort) holds the nucleus.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.core.batch import SampledToken, SampleSpec
from engine.core.sampling_params import SamplingParams
from engine.core.seeds import GOLDEN_GAMMA, MASK64, MIX1, MIX2, draw_key
from engine.runtime.grammar import GrammarKey, GrammarMatchers
from engine.runtime.transfer import to_device

_FIRST_CANDIDATES = 256  # top_p: candidates tried first; grows 8x until the nucleus fits


def _to_int64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _xor_shift_right_(z: torch.Tensor, bits: int, scratch: torch.Tensor) -> None:
    """z ^= z >>> bits (logical shift), in place."""
    torch.bitwise_right_shift(z, bits, out=scratch)
    # torch's >> on int64 is arithmetic; masking the sign-filled bits makes it logical.
    scratch.bitwise_and_((1 << (64 - bits)) - 1)
    z.bitwise_xor_(scratch)


def counter_uniforms(keys: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
    """u[i, j] = hash(keys[i], token_ids[i, j]) in the open interval (0, 1): [N, K] float64.

    A token's uniform depends only on its key and its id, so drawing among a subset of the
    vocabulary sees exactly the values the full vocabulary would. The splitmix64 finaliser
    (engine/core/seeds.py's mix64 is the reference it must match bit for bit) runs in place:
    fresh [N, V] buffers per op cost ~3x more in page faults on the CPU.
    """
    key = to_device([_to_int64(k) for k in keys], torch.int64, token_ids.device)
    # int64 add/multiply wrap modulo 2**64, exactly like the unsigned reference mix64().
    z = torch.add(token_ids, 1).mul_(_to_int64(GOLDEN_GAMMA)).add_(key[:, None])
    scratch = torch.empty_like(z)
    _xor_shift_right_(z, 30, scratch)
    z.mul_(_to_int64(MIX1))
    _xor_shift_right_(z, 27, scratch)
    z.mul_(_to_int64(MIX2))
    _xor_shift_right_(z, 31, scratch)
    z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)  # the top 53 bits
    return z.double().add_(0.5).mul_(2.0**-53)


@dataclass
class _Draw:
    """One token to draw: a row of the logits, its spec and one of its seeds."""

    row: int
    spec: SampleSpec
    seed: int
    grammar_key: GrammarKey | None = None  # the choice whose grammar masks this draw

    @property
    def params(self) -> SamplingParams:
        return self.spec.sampling_params


def _changes_logits(draw: _Draw) -> bool:
    """Whether a stage of Sampler._process writes this draw's row (the module docstring's
    order: grammar mask, logit_bias, min_tokens, repetition, presence/frequency)."""
    params = draw.params
    return (
        draw.grammar_key is not None
        or bool(params.logit_bias)
        or draw.spec.output_index < params.min_tokens
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass
class Drawn:
    """Draws whose device work is queued: token_ids [N] (one per draw, specs' order, seeds in
    order; None when there is none) stays on the device for a lookahead step to read;
    result() waits for the host copy and gives what Sampler.__call__ returns."""

    token_ids: torch.Tensor | None
    result: Callable[[], list[list[SampledToken]]]


class Sampler:
    """Stateless between calls but for the grammar matchers; `eos_token_ids` are what
    min_tokens keeps from being drawn. `grammars` masks the draws whose spec has
    grammar_keys (without it such a spec is an error)."""

    def __init__(
        self,
        eos_token_ids: Sequence[int],
        grammars: GrammarMatchers | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars
        # A faster argmax over the rows with the same answer as torch's (the CPU kernels'):
        # it returns None for logits it does not take, which then go to torch.
        self.argmax = argmax

    def __call__(
        self, logits: torch.Tensor, specs: Sequence[SampleSpec]
    ) -> list[list[SampledToken]]:
        """logits [B, V] (row i belongs to specs[i]) -> per spec, one SampledToken per seed."""
        return self.draw(logits, specs).result()

    def draw(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> Drawn:
        """__call__ with the host's wait left to Drawn.result(): the device work is queued."""
        draws = self._draws(specs)
        if not draws:
            return Drawn(None, lambda: [[] for _ in specs])
        raw = self._expand(logits, draws)  # [N, V]
        processed = self._process(raw, draws)
        token_ids = self._choose(processed, draws)  # [N]
        packed = self._pack(raw, token_ids, draws)
        return Drawn(token_ids, lambda: self._unpack(packed.tolist(), specs, draws))

    def by_argmax(
        self, specs: Sequence[SampleSpec], argmax: Callable[[], torch.Tensor | None]
    ) -> list[list[SampledToken]] | None:
        """What __call__ returns, from each row's argmax alone (argmax(): token ids [B], or None
        to decline), where every draw of `specs` is its row's argmax of the raw logits: greedy,
        no stage that changes logits, no logprobs. None otherwise (compute the logits)."""
        drawn = self.draw_by_argmax(specs, argmax)
        return None if drawn is None else drawn.result()

    def draw_by_argmax(
        self, specs: Sequence[SampleSpec], argmax: Callable[[], torch.Tensor | None]
    ) -> Drawn | None:
        """by_argmax with the host's wait left to Drawn.result(). The ids are copied: argmax()
        may return a buffer the next step writes (a CUDA graph's static output)."""
        draws = self._draws(specs)
        if not draws or not all(
            d.params.is_greedy and d.params.logprobs is None and not _changes_logits(d)
            for d in draws
        ):
            return None
        token_ids = argmax()
        if token_ids is None:
            return None
        if [d.row for d in draws] != list(range(token_ids.shape[0])):
            token_ids = token_ids.index_select(
                0, self._tensor([d.row for d in draws], token_ids.device)
            )
        else:
            token_ids = token_ids.clone()
        return Drawn(token_ids, lambda: self._unpack(token_ids.tolist(), specs, draws))

    def processed_logits(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
        """The logits after grammar masks, bias, min_tokens and penalties: [N, V], one row
        per seed (`logits` itself when no stage applies; never written)."""
        draws = self._draws(specs)
        return self._process(self._expand(logits, draws), draws)

    @staticmethod
    def _draws(specs: Sequence[SampleSpec]) -> list[_Draw]:
        return [
            _Draw(row, spec, seed, key)
            for row, spec in enumerate(specs)
            for seed, key in zip(
                spec.seeds, spec.grammar_keys or [None] * len(spec.seeds), strict=True
            )
        ]

    def _expand(self, logits: torch.Tensor, draws: list[_Draw]) -> torch.Tensor:
        raw = logits.float()  # [B, V]
        rows = [d.row for d in draws]
        if rows != list(range(raw.shape[0])):  # n > 1: each extra seed draws from a row copy
            raw = raw.index_select(0, self._tensor(rows, raw.device))
        return raw

    def _process(self, raw: torch.Tensor, draws: list[_Draw]) -> torch.Tensor:
        """raw after the stages that change logits, in a copy; raw itself when none applies
        (no copy of [N, V] for plain greedy or temperature rows)."""
        if not any(_changes_logits(d) for d in draws):
            return raw
        logits = raw.clone()
        self._apply_grammar_masks(logits, draws)
        self._apply_logit_bias(logits, draws)
        self._apply_min_tokens(logits, draws)
        self._apply_repetition_penalty(logits, draws)
        self._apply_presence_frequency(logits, draws)
        return logits

    def _apply_grammar_masks(self, logits: torch.Tensor, draws: list[_Draw]) -> None:
        """One bitmask for the batch: each constrained row filled by its choice's matcher."""
        rows = [i for i, d in enumerate(draws) if d.grammar_key is not None]
        if not rows:
            return
        if self.grammars is None:
            raise RuntimeError("a grammar-constrained draw reached a sampler without grammars")
        keys = [draws[i].grammar_key for i in rows]
        histories = [draws[i].spec.output_token_ids for i in rows]
        self.grammars.apply_masks(logits, rows, keys, histories)

    def _apply_logit_bias(self, logits: torch.Tensor, draws: list[_Draw]) -> None:
        entries = [(i, t, b) for i, d in enumerate(draws) for t, b in d.params.logit_bias.items()]
        if entries:
            rows, cols, values = zip(*entries, strict=True)
            index = (self._tensor(rows, logits.device), self._tensor(cols, logits.device))
            logits.index_put_(index, self._floats(values, logits), accumulate=True)

    def _apply_min_tokens(self, logits: torch.Tensor, draws: list[_Draw]) -> None:
        rows, cols = [], []
        for i, draw in enumerate(draws):
            params = draw.params
            if draw.spec.output_index >= params.min_tokens:
                continue
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(self.eos_token_ids)
            rows += [i] * len(banned)
            cols += sorted(banned)
        if rows:
            index = (self._tensor(rows, logits.device), self._tensor(cols, logits.device))
            logits[index] = float("-inf")

    def _apply_repetition_penalty(self, logits: torch.Tensor, draws: list[_Draw]) -> None:
        selected = [i for i, d in enumerate(draws) if d.params.repetition_penalty != 1.0]
        if not selected:
            return
        histories = [
            draws[i].spec.prompt_token_ids + draws[i].spec.output_token_ids for i in selected
        ]
        seen = self._token_counts(histories, logits.shape[1], logits.device) > 0  # [S, V]
        penalty = self._floats([draws[i].params.repetition_penalty for i in selected], logits)
        rows = self._tensor(selected, logits.device)
        values = logits[rows]  # [S, V]
        # HF semantics: shrink seen tokens' logits towards 0 from either side.
        penalised = torch.where(values > 0, values / penalty[:, None], values * penalty[:, None])
        logits[rows] = torch.where(seen, penalised, values)

    def _apply_presence_frequency(self, logits: torch.Tensor, draws: list[_Draw]) -> None:
        selected = [
            i
            for i, d in enumerate(draws)
            if d.params.presence_penalty != 0.0 or d.params.frequency_penalty != 0.0
        ]
        if not selected:
            return
        histories = [draws[i].spec.output_token_ids for i in selected]
        counts = self._token_counts(histories, logits.shape[1], logits.device)  # [S, V]
        presence = self._floats([draws[i].params.presence_penalty for i in selected], logits)
        frequency = self._floats([draws[i].params.frequency_penalty for i in selected], logits)
        rows = self._tensor(selected, logits.device)
        logits[rows] -= frequency[:, None] * counts + presence[:, None] * (counts > 0)

    def _choose(self, logits: torch.Tensor, draws: list[_Draw]) -> torch.Tensor:
        token_ids = self.argmax(logits) if self.argmax is not None else None
        if token_ids is None:
            token_ids = logits.argmax(dim=-1)  # [N]; the answer for greedy rows
        random_draws = [(i, d) for i, d in enumerate(draws) if not d.params.is_greedy]
        is_plain = [d.params.top_k == -1 and d.params.top_p == 1.0 for _, d in random_draws]
        plain = [pair for pair, yes in zip(random_draws, is_plain, strict=True) if yes]
        truncated = [pair for pair, yes in zip(random_draws, is_plain, strict=True) if not yes]
        for group, sample in ((plain, self._sample_full), (truncated, self._sample_truncated)):
            if group:
                rows = self._tensor([i for i, _ in group], logits.device)
                token_ids[rows] = sample(logits[rows], [d for _, d in group])
        return token_ids

    def _sample_full(self, logits: torch.Tensor, draws: list[_Draw]) -> torch.Tensor:
        """Rows without top_k/top_p: temperature and min_p over the whole vocabulary."""
        params = [d.params for d in draws]
        temperature = self._floats([p.temperature for p in params], logits)[:, None]
        probs = (logits / temperature).softmax(dim=-1)
        vocab = torch.arange(logits.shape[1], device=logits.device).expand_as(probs)
        return self._race(self._apply_min_p(probs, params), vocab, draws)

    def _sample_truncated(self, logits: torch.Tensor, draws: list[_Draw]) -> torch.Tensor:
        """Rows with top_k and/or top_p: sample among the sorted top candidates only."""
        params = [d.params for d in draws]
        scaled = logits / self._floats([p.temperature for p in params], logits)[:, None]
        vocab_size = scaled.shape[1]
        top_k = [p.top_k if p.top_k != -1 else vocab_size for p in params]
        uncapped = any(p.top_k == -1 for p in params)  # top_p alone: nucleus size unknown
        # The CPU grows the candidate set until it holds every nucleus (a full sort costs
        # ~100 ms at batch 32); CUDA sorts everything at once rather than sync on the check.
        num = vocab_size if logits.is_cuda or not uncapped else _FIRST_CANDIDATES
        num = min(vocab_size, max([num, *(k for k in top_k if k < vocab_size)]))
        while True:
            values, candidate_ids = scaled.topk(num, dim=-1)  # [R, K], sorted descending
            probs, covered = self._nucleus(values, scaled, params, top_k)
            if num == vocab_size or not uncapped or bool(covered.all()):
                break
            num = min(vocab_size, num * 8)
        return self._race(self._apply_min_p(probs, params), candidate_ids, draws)

    def _nucleus(self, values, scaled, params: list[SamplingParams], top_k: list[int]):
        """Probabilities [R, K] of the sorted candidates after top_k and top_p (others 0),
        and per row whether the candidates hold everything top_p keeps."""
        ranks = torch.arange(values.shape[1], device=values.device)
        k = self._tensor(top_k, values.device)[:, None]
        values = values.masked_fill(ranks[None, :] >= k, float("-inf"))
        # Normalise over the top-k when a row has one, else over the whole vocabulary.
        has_top_k = k[:, 0] < scaled.shape[1]
        log_total = torch.where(has_top_k, values.logsumexp(-1), scaled.logsumexp(-1))
        probs = (values - log_total[:, None]).exp()
        top_p = self._floats([p.top_p for p in params], probs)[:, None]
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = (mass_before >= top_p) & (top_p < 1.0)
        covered = has_top_k | outside[:, -1] | (top_p[:, 0] >= 1.0)
        return probs.masked_fill(outside, 0.0), covered

    def _apply_min_p(self, probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if all(p.min_p == 0.0 for p in params):
            return probs
        min_p = self._floats([p.min_p for p in params], probs)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        return probs.masked_fill(probs < threshold, 0.0)

    def _race(
        self, probs: torch.Tensor, token_ids: torch.Tensor, draws: list[_Draw]
    ) -> torch.Tensor:
        """Exponential race over candidates: the token with the largest p / E wins, [R]."""
        keys = [draw_key(d.seed, d.spec.output_index) for d in draws]
        exponentials = counter_uniforms(keys, token_ids).log_().neg_()  # [R, K]
        winner = probs.double().div_(exponentials).argmax(dim=-1, keepdim=True)
        return token_ids.gather(1, winner)[:, 0]

    def _pack(self, raw: torch.Tensor, token_ids: torch.Tensor, draws: list[_Draw]) -> torch.Tensor:
        """Token ids, then per logprob row [logprob, top ids..., top logprobs...], in one tensor.

        Packing into one float64 vector (ids are exact below 2**53) costs one host sync.
        """
        parts = [token_ids.double()]
        lp_rows = [i for i, d in enumerate(draws) if d.params.logprobs is not None]
        if lp_rows:
            rows = self._tensor(lp_rows, raw.device)
            logprobs = torch.log_softmax(raw[rows], dim=-1)  # [L, V]
            chosen = logprobs.gather(1, token_ids[rows][:, None])  # [L, 1]
            num_top = max(draws[i].params.logprobs for i in lp_rows)
            top = logprobs.topk(num_top, dim=-1) if num_top else None
            columns = [chosen] if top is None else [chosen, top.indices.double(), top.values]
            parts.append(torch.cat([c.double() for c in columns], dim=1).flatten())
        return torch.cat(parts)

    def _unpack(
        self, packed: list[float], specs: Sequence[SampleSpec], draws: list[_Draw]
    ) -> list[list[SampledToken]]:
        results: list[list[SampledToken]] = [[] for _ in specs]
        num_top = max((d.params.logprobs or 0) for d in draws)
        cursor = len(draws)
        for i, draw in enumerate(draws):
            token = SampledToken(token_id=int(packed[i]))
            if draw.params.logprobs is not None:
                record = packed[cursor : cursor + 1 + 2 * num_top]
                cursor += 1 + 2 * num_top
                wanted = draw.params.logprobs
                token.logprob = record[0]
                ids, values = record[1 : 1 + num_top], record[1 + num_top :]
                token.top_logprobs = [(int(t), v) for t, v in zip(ids, values, strict=True)][
                    :wanted
                ]
            results[draw.row].append(token)
        return results

    @staticmethod
    def _token_counts(histories: list[list[int]], vocab_size: int, device) -> torch.Tensor:
        """counts[i, v] = occurrences of token v in histories[i]: [S, V] float32."""
        rows = [i for i, history in enumerate(histories) for _ in history]
        cols = [t for history in histories for t in history]
        counts = torch.zeros(len(histories), vocab_size, device=device)
        if cols:
            index = (Sampler._tensor(rows, device), Sampler._tensor(cols, device))
            counts.index_put_(index, torch.ones(len(cols), device=device), accumulate=True)
        return counts

    @staticmethod
    def _tensor(values: Sequence[int], device) -> torch.Tensor:
        return to_device(values, torch.int64, device)

    @staticmethod
    def _floats(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        return to_device(values, like.dtype, like.device)
