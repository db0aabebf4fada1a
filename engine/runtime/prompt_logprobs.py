"""Prompt logprobs (echo with logprobs): the log-softmax of the logits at the prompt positions
a prefill chunk computes, only for the sequences whose chunk carries a PromptLogprobsSpec.

Row r of a chunk is position start_pos + r; its logits predict the token at start_pos + r + 1,
so a target's logprob is log_softmax(logits[row])[target]. Other steps pay nothing: the LM
head runs on these rows only when some chunk asks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.core.batch import SampledToken, ScheduledSeq
from engine.runtime.transfer import split_to_device

# [256, V] fp32 logits are 50 MB at V = 49152: a long prompt is scored a slice at a time.
_ROWS_PER_PASS = 256


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Sequence[ScheduledSeq],
    query_start_loc: Sequence[int],
) -> dict[int, list[SampledToken]]:
    """hidden [T, E] of the whole step; query_start_loc[i]: the first row of seqs[i].

    Returns seq_id -> one SampledToken per target (its logprob and num_top alternatives)."""
    jobs = [(i, seq) for i, seq in enumerate(seqs) if seq.prompt_logprobs is not None]
    if not jobs:
        return {}
    rows: list[int] = []
    targets: list[int] = []
    for i, seq in jobs:
        spec = seq.prompt_logprobs
        first = query_start_loc[i] + spec.row_offset
        rows += range(first, first + len(spec.target_token_ids))
        targets += spec.target_token_ids
    num_top = max(seq.prompt_logprobs.num_top for _, seq in jobs)
    row_index, target_ids = split_to_device([rows, targets], hidden.device)
    packed = torch.cat(
        [
            _score(
                compute_logits(hidden[row_index[s : s + _ROWS_PER_PASS]]), target_ids, s, num_top
            )
            for s in range(0, len(rows), _ROWS_PER_PASS)
        ]
    ).tolist()  # [R, 1 + 2 * num_top]: one host sync for the step
    return _unpack(packed, jobs, num_top)


def _score(logits: torch.Tensor, target_ids: torch.Tensor, start: int, num_top: int):
    """logits [R, V] of rows start.. -> [R, 1 + 2 * num_top] float64: the target's logprob,
    then the top ids, then their logprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = logprobs.gather(1, target_ids[start : start + logits.shape[0], None])  # [R, 1]
    columns = [chosen]
    if num_top:
        top = logprobs.topk(num_top, dim=-1)
        columns += [top.indices, top.values]
    return torch.cat([c.double() for c in columns], dim=1)


def _unpack(
    packed: list[list[float]], jobs: list[tuple[int, ScheduledSeq]], num_top: int
) -> dict[int, list[SampledToken]]:
    results: dict[int, list[SampledToken]] = {}
    cursor = 0
    for _, seq in jobs:
        spec = seq.prompt_logprobs
        scored = []
        for target, record in zip(
            spec.target_token_ids, packed[cursor : cursor + len(spec.target_token_ids)], strict=True
        ):
            ids, values = record[1 : 1 + num_top], record[1 + num_top :]
            top = [(int(t), v) for t, v in zip(ids, values, strict=True)][: spec.num_top]
            scored.append(SampledToken(target, record[0], top))
        cursor += len(spec.target_token_ids)
        results[seq.seq_id] = scored
    return results
