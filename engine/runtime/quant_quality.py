"""How far a quantized mode's model is from the exact one, teacher-forced on a fixed text.

Used by benchmarks/quality.py and the quantization tests. The text runs through a model
runner's own forward (paged KV, prefill chunks, the runner's attention backend and linears),
so what is scored is what the engine serves. Per position t the model sees tokens[: t + 1]
and is scored on tokens[t + 1]:

- top-1 agreement: the fraction of positions whose argmax equals the exact model's argmax;
- perplexity ratio: exp(mean NLL of the mode) / exp(mean NLL of the exact model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.core.batch import ScheduledSeq, SchedulerOutput
from engine.runtime.model_runner import ModelRunner
from engine.runtime.step_inputs import prepare_inputs


@dataclass(frozen=True)
class TextScore:
    """One model's teacher-forced reading of a text: per scored position (T - 1 of them)."""

    top1_ids: torch.Tensor  # [T - 1] argmax of the logits at each position
    nll: torch.Tensor  # [T - 1] -log p(next token), fp64 sums stay exact enough

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.double().mean().item())


@dataclass(frozen=True)
class Agreement:
    num_positions: int
    top1_agreement: float
    perplexity_exact: float
    perplexity: float

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.perplexity_exact


def score_text(
    runner: ModelRunner, token_ids: list[int], chunk_tokens: int = 256, as_prompt: bool = True
) -> TextScore:
    """Teacher-force `token_ids` through the runner's model in prefill chunks of
    `chunk_tokens`, as one sequence in blocks 0.. of the runner's KV pool: as a prompt's tokens,
    or (as_prompt False) as tokens the model generated, which the runner may compute on another
    kernel path (step_inputs.tile_rows)."""
    block_size = runner.block_size
    table = list(range(-(-len(token_ids) // block_size)))
    if len(table) > runner.num_kv_blocks or len(token_ids) > runner.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens do not fit this runner's KV pool or context")
    rows = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), chunk_tokens):
            chunk = token_ids[start : start + chunk_tokens]
            end = start + len(chunk)
            seq = ScheduledSeq(0, chunk, start, table[: -(-end // block_size)])
            seq.prompt_len = len(token_ids) if as_prompt else 0
            slots = [
                table[p // block_size] * block_size + p % block_size for p in range(start, end)
            ]
            rows.append(_chunk_logprobs(runner, SchedulerOutput(seqs=[seq], slot_mapping=slots)))
    logprobs = torch.cat(rows)[:-1]  # [T - 1, V]: the last position has no next token
    targets = torch.tensor(token_ids[1:])
    nll = -logprobs.gather(1, targets[:, None])[:, 0]
    return TextScore(top1_ids=logprobs.argmax(dim=1), nll=nll)


def _chunk_logprobs(runner: ModelRunner, step: SchedulerOutput) -> torch.Tensor:
    inputs = prepare_inputs(step, runner.device, runner.tile_prompts)
    model = runner.model
    hidden = model(
        inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, runner.attn_backend
    )
    return torch.log_softmax(model.compute_logits(hidden), dim=-1).cpu()


def compare(exact: TextScore, other: TextScore) -> Agreement:
    """`other` scored against `exact` on the same text."""
    agree = (exact.top1_ids == other.top1_ids).double().mean().item()
    return Agreement(
        num_positions=len(exact.nll),
        top1_agreement=agree,
        perplexity_exact=exact.perplexity,
        perplexity=other.perplexity,
    )
