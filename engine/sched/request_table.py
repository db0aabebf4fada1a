"""The scheduler's live requests and sequences, its two queues, and every change of a
sequence's state (torch-free).

A live sequence is in exactly one queue: WAITING ones in `waiting` (holding no blocks),
RUNNING ones in `running`. Admission moves one to the back of `running`, preemption back to
the front of `waiting`, a fork adds the children next to their parent, and retiring frees the
blocks and drops the sequence from its queue and `seqs`. A request is kept until all its
choices have finished; the delta that says so is its last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.core.errors import ChoiceNotForked
from engine.core.protocol import CompletionOutput, FinishReason, RequestOutput
from engine.core.sequence import Request, Sequence, SequenceStatus
from engine.kv.kv_cache_manager import KVCacheManager


class RequestTable:
    """Unfinished requests and sequences, by id and in queue order.

    The Scheduler reads `requests`, `seqs`, `waiting` and `running` and changes them only
    through the methods here, which keep them consistent with each sequence's status and free
    blocks through KVCacheManager. Engine thread only.
    """

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.seqs: dict[int, Sequence] = {}  # unfinished sequences by id, oldest first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self._pending_outputs: list[RequestOutput] = []  # finished outside a model step
        self._finished_request_ids: list[str] = []  # since the last take_finished_request_ids
        self._next_seq_id = 0

    @property
    def num_seats(self) -> int:
        """Running choices: an unforked n-choice sequence takes n seats (it forks into n)."""
        return sum(seq.num_choices for seq in self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    # -- transitions -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new request; its one sequence joins the back of the waiting queue."""
        (seq,) = request.sequences
        self.requests[request.request_id] = request
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def admit(self, seq: Sequence) -> None:
        """Waiting -> running (the newest), once KVCacheManager.admit gave it its blocks."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks, put it at the front of the waiting queue."""
        self.kv_cache_manager.free(seq)
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def fork(self, seq: Sequence) -> list[Sequence]:
        """[seq] for one choice; at an n-choice parent's first sample, its n choices."""
        if seq.num_choices == 1:
            return [seq]
        children = [seq.make_child(self.new_seq_id(), i) for i in range(1, seq.num_choices)]
        seq.num_choices = 1
        position = self.running.index(seq) + 1
        self.running[position:position] = children  # as old as their parent
        for child in children:
            self.kv_cache_manager.fork(seq, child)
            self.seqs[child.seq_id] = child
        self.requests[seq.request_id].add_children(children)
        return [seq, *children]

    def retire(self, seq: Sequence, reason: FinishReason) -> None:
        """Free seq's blocks at once and drop it from the queues."""
        self.kv_cache_manager.free(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish(reason)
        del self.seqs[seq.seq_id]

    # -- finishing ---------------------------------------------------------------------------
    def abort(
        self, request_id: str, choice_index: int | None, reason: FinishReason
    ) -> RequestOutput | None:
        """Finish the request, or its forked choice `choice_index`, with `reason`; its delta,
        or None when unknown or already finished. ChoiceNotForked before the fork."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        seqs = request.unfinished_sequences()
        if choice_index is not None:
            seq = request.sequence_for_choice(choice_index)
            if seq is None or seq.is_finished:
                return None
            if seq.num_choices > 1:
                raise ChoiceNotForked(
                    f"choice {choice_index} of request {request_id} has not forked yet"
                )
            seqs = [seq]
        completions = [c for seq in seqs for c in self.finish_quietly(seq, reason)]
        return self.request_output(request, completions)

    def fail_seqs(self, seq_ids: Iterable[int], message: str) -> list[RequestOutput]:
        """fail_request for every request owning a live sequence of seq_ids."""
        request_ids = dict.fromkeys(
            self.seqs[seq_id].request_id for seq_id in seq_ids if seq_id in self.seqs
        )
        return [self.fail_request(self.requests[r], message) for r in request_ids]

    def finish_quietly(self, seq: Sequence, reason: FinishReason) -> list[CompletionOutput]:
        """Retire seq; a final, empty delta for each choice it stood for."""
        self.retire(seq, reason)
        return seq.final_completions()

    def fail_request(self, request: Request, message: str) -> RequestOutput:
        """Finish every unfinished choice of `request` with ERROR; its final delta."""
        seqs = request.unfinished_sequences()
        completions = [c for seq in seqs for c in self.finish_quietly(seq, FinishReason.ERROR)]
        return self.request_output(request, completions, error=message)

    def request_output(
        self, request: Request, completions: list[CompletionOutput], error: str | None = None
    ) -> RequestOutput:
        """The delta for `request`; forgets the request once every choice has finished."""
        if request.is_finished:
            del self.requests[request.request_id]
            self._finished_request_ids.append(request.request_id)
        return request.make_output(completions, error)

    def add_pending_output(self, output: RequestOutput) -> None:
        """A delta made outside a model step, returned by the next take_pending_outputs()."""
        self._pending_outputs.append(output)

    def take_pending_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def take_finished_request_ids(self) -> list[str]:
        ids, self._finished_request_ids = self._finished_request_ids, []
        return ids

    def check_integrity(self) -> None:
        """Queues, statuses and block tables agree; refcounts == live references."""
        live = list(self.seqs.values())
        self.kv_cache_manager.check_integrity(live)
        assert len(self.waiting) + len(self.running) == len(live), "a live seq is lost"
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_ids, seq.seq_id
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, seq.seq_id
            num_blocks = self.kv_cache_manager.num_blocks_for(seq.num_computed_tokens)
            assert len(seq.block_ids) == num_blocks, f"seq {seq.seq_id}: {seq.block_ids}"
        for request in self.requests.values():
            assert not request.is_finished, f"finished request {request.request_id} kept"
