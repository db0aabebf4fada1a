"""One step's inputs: a SchedulerOutput flattened into device tensors (one host-to-device copy).

Axes: T tokens of the step, S rows to sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.batch import SampleSpec, ScheduledSeq, SchedulerOutput
from engine.core.spec_ngram import verify_specs
from engine.runtime.attention.base import AttentionMetadata
from engine.runtime.transfer import split_to_device


@dataclass
class StepInputs:
    """One step's tensors on the device, plus which rows get sampled."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # [S] flattened rows to sample: each sampled sequence's last token, or with a draft each
    # of its 1 + k verified positions (sample_seq_ids then repeats its id)
    logits_indices: torch.Tensor
    sample_seq_ids: list[int]
    sample_specs: list[SampleSpec]


def prepare_inputs(
    sched_out: SchedulerOutput, device: torch.device, tile_prompts: bool = False
) -> StepInputs:
    """Flatten a SchedulerOutput into tensors with a single host-to-device transfer;
    tile_prompts: the prompt tokens' projections run on AMX tiles (meta.tile_rows)."""
    seqs = sched_out.seqs
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc, seq_lens, logits_indices = [0], [], []
    sampled = [(s.seq_id, spec) for s in seqs if s.sample is not None for spec in _row_specs(s)]
    for seq in seqs:
        input_ids += seq.token_ids
        positions += range(seq.start_pos, seq.context_len)
        query_start_loc.append(query_start_loc[-1] + seq.num_tokens)
        seq_lens.append(seq.context_len)
        if seq.sample is not None:
            end = query_start_loc[-1]
            logits_indices += range(end - 1 - len(seq.draft_token_ids), end)
    _check_batch(sched_out, len(input_ids))
    width = max(len(seq.block_ids) for seq in seqs)
    tables = [b for seq in seqs for b in seq.block_ids + [0] * (width - len(seq.block_ids))]
    parts = (input_ids, positions, sched_out.slot_mapping, query_start_loc, seq_lens)
    ids, pos, slots, qsl, lens, logits_rows, table_flat = split_to_device(
        [*parts, logits_indices, tables], device
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl.int(),
        seq_lens=lens.int(),
        block_tables=table_flat.view(len(seqs), width).int(),
        num_decodes=sched_out.num_decodes,
        max_seq_len=max(seq_lens),
        max_query_len=max(seq.num_tokens for seq in seqs),
        query_start_loc_host=query_start_loc,
        seq_lens_host=seq_lens,
        tile_rows=tile_rows(seqs) if tile_prompts else None,
    )
    return StepInputs(ids, pos, meta, logits_rows, [i for i, _ in sampled], [s for _, s in sampled])


def tile_rows(seqs: list[ScheduledSeq]) -> torch.Tensor:
    """[T] int32: 1 for a prompt token's row (position < its prompt_len), 0 for a generated
    token's (the kernels' default path: a decode row's path is 0 in every step).

    On an AMX Xeon a prefill chunk runs faster on the tiles and a lone decode row slower
    (amx_panels.cpp, "Panels on AMX tiles"), and the two paths give different bits: choosing by
    the token, never by the batch, keeps a request's text independent of what else runs. One
    trade: a finished answer reused as the next turn's cached prompt holds the FMAs' KV where a
    recompute would give the tiles' (the audit finds drift at most, never pollution)."""
    rows: list[int] = []
    for seq in seqs:
        prompt = min(max(seq.prompt_len - seq.start_pos, 0), seq.num_tokens)
        rows += [1] * prompt + [0] * (seq.num_tokens - prompt)
    return torch.tensor(rows, dtype=torch.int32)


def _row_specs(seq: ScheduledSeq) -> list[SampleSpec]:
    """The SampleSpec of each row seq samples: its last token's, or one per verified position."""
    if seq.draft_token_ids:
        return verify_specs(seq.sample, seq.draft_token_ids)
    return [seq.sample]


def _check_batch(sched_out: SchedulerOutput, num_tokens: int) -> None:
    # Cheap python checks: a malformed batch would otherwise write KV into wrong slots.
    if len(sched_out.slot_mapping) != num_tokens:
        raise ValueError(
            f"slot_mapping has {len(sched_out.slot_mapping)} slots for {num_tokens} tokens"
        )
    if any(seq.num_tokens != 1 for seq in sched_out.seqs[: sched_out.num_decodes]):
        raise ValueError("every decode sequence must schedule exactly one token")
