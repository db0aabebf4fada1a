"""A step's ModelRunnerOutput applied to the sequences the step scheduled (torch-free).

Per scheduled sequence: its computed chunk's full blocks go to the prefix cache, its prompt
logprobs are kept, and a sampled token is appended (an n-choice sequence forks into its
choices at its first token), counted and charged to its tenant; the stop checks may retire
it. A sequence that carried a draft is verified instead (engine/sched/spec_scheduling.py).
"""

from __future__ import annotations

from engine.core.batch import ModelRunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from engine.core.protocol import CompletionOutput, FinishReason, RequestOutput
from engine.core.sequence import Sequence
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sched.fair_share import FairShare
from engine.sched.request_table import RequestTable
from engine.sched.scheduler_stats import SchedulerCounters
from engine.sched.spec_scheduling import SpecScheduling


class OutputProcessor:
    """The work of Scheduler.update_from_output(): mutates the sequences, the RequestTable,
    the counters and the tenants' charges. Engine thread only."""

    def __init__(
        self,
        table: RequestTable,
        kv_cache_manager: KVCacheManager,
        spec: SpecScheduling,
        counters: SchedulerCounters,
        fair_share: FairShare,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.table = table
        self.kv_cache_manager = kv_cache_manager
        self.spec = spec
        self.counters = counters
        self.fair_share = fair_share
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """One delta per request that changed, after the requests finished outside a step;
        sequences finished since schedule() (aborted, failed) are skipped."""
        completions: dict[str, list[CompletionOutput]] = {}
        for scheduled in scheduler_output.seqs:
            seq = self.table.seqs.get(scheduled.seq_id)
            if seq is None:
                continue
            if scheduled.draft_token_ids:
                completion = self._verify(seq, scheduled, runner_output)
                completions.setdefault(seq.request_id, []).append(completion)
                continue
            self.kv_cache_manager.insert_prefix(seq)  # its chunk is computed: cache full blocks
            if scheduled.prompt_logprobs is not None:
                seq.add_prompt_logprobs(runner_output.prompt_logprobs[seq.seq_id])
            if scheduled.sample is None:
                if seq.is_prompt_only and seq.num_uncomputed_tokens == 0:
                    completions.setdefault(seq.request_id, []).extend(
                        self.table.finish_quietly(seq, FinishReason.LENGTH)
                    )
                continue
            sampled = self._sampled_tokens(runner_output, seq)
            for choice_seq, token in zip(self.table.fork(seq), sampled, strict=True):
                completion = self._append_token(choice_seq, token)
                completions.setdefault(seq.request_id, []).append(completion)
        outputs = self.table.take_pending_outputs()
        for request_id, request_completions in completions.items():
            request = self.table.requests[request_id]
            outputs.append(self.table.request_output(request, request_completions))
        return outputs

    @staticmethod
    def _sampled_tokens(runner_output: ModelRunnerOutput, seq: Sequence) -> list[SampledToken]:
        sampled = runner_output.sampled.get(seq.seq_id)
        if sampled is None or len(sampled) != seq.num_choices:
            raise RuntimeError(
                f"runner returned {sampled!r} for seq {seq.seq_id}, "
                f"expected {seq.num_choices} sampled token(s)"
            )
        return sampled

    def _verify(
        self, seq: Sequence, scheduled: ScheduledSeq, runner_output: ModelRunnerOutput
    ) -> CompletionOutput:
        completion, num_kept = self.spec.verify(seq, scheduled, runner_output, self._append_token)
        self.counters.num_spec_draft_tokens += len(scheduled.draft_token_ids)
        self.counters.num_spec_accepted_tokens += num_kept
        return completion

    def _append_token(self, seq: Sequence, token: SampledToken) -> CompletionOutput:
        seq.output_token_ids.append(token.token_id)
        self.counters.num_generation_tokens += 1
        self.fair_share.charge_output(seq.tenant)
        reason, stop_token_id = seq.check_stop(self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self.kv_cache_manager.insert_prefix(seq)  # prompt + outputs, for the next turn
            self.table.retire(seq, reason)
        return seq.completion(token, reason, stop_token_id)
