"""AsyncEngine: the EngineClient that app/ uses. One engine thread steps an LLMEngine;
asyncio queues carry the deltas back to the event loop.

Thread contract: only the engine thread touches the LLMEngine (add, abort, step). The event
loop talks to it through a command queue, and receives RequestOutputs through per-request
asyncio queues fed with loop.call_soon_threadsafe. Commands are applied between steps, so an
abort takes effect within one step; so is a fault drill (inject_fault), whose report comes
back through a future, and so is the KV block-hash listing (kv_block_hashes).

Stats flow one way: after every step the engine thread hands the step's immutable EngineStats
to the event loop together with the step's outputs; the loop keeps the latest (stats()) and
passes each snapshot once to every stats listener (the server's metrics), so nothing on the
loop ever calls into the engine for figures.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.core.config import EngineConfig
from engine.core.errors import (
    ChoiceNotForked,
    DuplicateRequest,
    EngineNotReady,
    FaultInjectionDisabled,
    KVEventsDisabled,
    KVShareError,
)
from engine.core.protocol import (
    AdmittedRequest,
    EngineRequest,
    EngineStats,
    FaultReport,
    ModelInfo,
    RequestOutput,
)
from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    admitted: AdmittedRequest


@dataclass
class _Abort:
    request_id: str
    choice_index: int | None


@dataclass
class _InjectFault:
    kind: str
    block_id: int | None
    other_block_id: int | None
    result: Future[FaultReport] = field(default_factory=Future)


@dataclass
class _ListKVBlocks:
    result: Future[list[int]] = field(default_factory=Future)


class _Stop:
    pass


_Command = _Add | _Abort | _InjectFault | _ListKVBlocks | _Stop


class AsyncEngine:
    """EngineClient over an LLMEngine running in its own thread."""

    def __init__(
        self, config: EngineConfig, engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
    ) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self._engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: str | None = None
        self._num_waiting = 0
        self._stats = EngineStats()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvshare-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, 30.0)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._thread is not None and self._thread.is_alive()

    @property
    def load_error(self) -> str | None:
        return self._load_error

    @property
    def model_info(self) -> ModelInfo:
        if self._engine is None:
            raise EngineNotReady("the model is not loaded yet")
        return self._engine.model_info

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published (read on the event loop)."""
        return self._stats

    def add_stats_listener(self, listener: Callable[[EngineStats], None]) -> None:
        """listener(snapshot) runs on the event loop once for every published snapshot."""
        self._stats_listeners.append(listener)

    # -- requests -----------------------------------------------------------------------
    def admit(self, request: EngineRequest, prompt_param: str = "prompt") -> AdmittedRequest:
        """LLMEngine.admit on the caller's thread: the request's one check against the model
        and its grammar's one compile (or cache hit; GrammarCache is thread-safe). Blocking:
        app/ calls it from the worker thread that prepares the request, so neither the event
        loop nor the engine thread waits on a compile. ParamError names a bad field (a schema
        that cannot be compiled in time: response_format); EngineNotReady before the model is
        loaded."""
        engine = self._engine
        if engine is None:
            raise EngineNotReady("the model is not loaded yet")
        return engine.admit(request, prompt_param)

    async def generate(self, admitted: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        """Yield deltas until finished; leaving early (disconnect) aborts the request.

        Only what the engine's own state depends on is checked here: a request id that is
        still running raises DuplicateRequest, and a request that breaks the scheduler's
        asserts ends with RequestOutput.error while the engine keeps serving.
        """
        request_id = admitted.request.request_id
        if request_id in self._streams:
            raise DuplicateRequest(request_id)
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = stream
        self._num_waiting += 1
        self._commands.put(_Add(admitted))
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id, None))

    async def abort(self, request_id: str, choice_index: int | None = None) -> None:
        self._commands.put(_Abort(request_id, choice_index))

    async def inject_fault(
        self, kind: str, block_id: int | None = None, other_block_id: int | None = None
    ) -> FaultReport:
        """Fault drill, applied by the engine thread between two steps. Raises
        FaultInjectionDisabled when disabled, EngineNotReady when the engine is not running,
        and what LLMEngine.inject_fault raises (UnknownFaultKind, InvalidFaultTarget)."""
        if not self.config.enable_fault_injection:
            raise FaultInjectionDisabled("fault injection is disabled (--enable-fault-injection)")
        if not self.is_ready:
            raise EngineNotReady("the engine is not running")
        command = _InjectFault(kind, block_id, other_block_id)
        self._commands.put(command)
        return await asyncio.wrap_future(command.result)

    async def kv_block_hashes(self) -> list[int]:
        """The KV event hashes of every cached block, sorted, read by the engine thread
        between two steps. Raises KVEventsDisabled unless kv_events_endpoint is set,
        EngineNotReady when the engine is not running."""
        if not self.config.kv_events_endpoint:
            raise KVEventsDisabled("KV events are disabled (--kv-events-endpoint)")
        if not self.is_ready:
            raise EngineNotReady("the engine is not running")
        command = _ListKVBlocks()
        self._commands.put(command)
        return await asyncio.wrap_future(command.result)

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._engine = self._engine_factory(self.config)
        except KVShareError as exc:  # refused on purpose: the message is the whole story
            self._load_error = f"{type(exc).__name__}: {exc}"
            return
        except Exception as exc:
            logger.exception("loading the model failed")
            self._load_error = f"{type(exc).__name__}: {exc}"
            return
        self._ready.set()
        engine = self._engine
        self._deliver([], engine.latest_stats)  # what loading found (a restored tier) shows now
        while True:
            block = not engine.has_unfinished_requests()
            if not self._apply_commands(engine, block=block):
                break
            self._num_waiting = engine.scheduler.num_waiting
            try:
                outputs = engine.step()  # when idle, this runs the engine's leak check
            except Exception as exc:  # a bug outside the model: fail the live requests, go on
                logger.exception("engine step failed")
                outputs = self._fail_live_requests(engine, f"{type(exc).__name__}: {exc}")
            self._deliver(outputs, engine.latest_stats)
        engine.close()  # asked to stop: the KV event publisher sends what is queued, then ends

    @staticmethod
    def _fail_live_requests(engine: LLMEngine, reason: str) -> list[RequestOutput]:
        seq_ids = [seq.seq_id for seq in engine.scheduler.live_sequences()]
        return engine.scheduler.fail_seqs(seq_ids, f"engine fault: {reason}")

    def _apply_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        try:
            command = self._commands.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._add(engine, command.admitted)
            elif isinstance(command, _InjectFault):
                self._inject_fault(engine, command)
            elif isinstance(command, _ListKVBlocks):
                self._list_kv_blocks(engine, command)
            else:
                self._abort(engine, command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _abort(self, engine: LLMEngine, command: _Abort) -> None:
        try:
            outputs = engine.abort_request(command.request_id, command.choice_index)
        except ChoiceNotForked:  # its choices share one sequence still: abort them all
            outputs = engine.abort_request(command.request_id, None)
        self._deliver(outputs)

    @staticmethod
    def _inject_fault(engine: LLMEngine, command: _InjectFault) -> None:
        try:
            report = engine.inject_fault(command.kind, command.block_id, command.other_block_id)
        except Exception as exc:  # refused or bad target: the caller reads it
            command.result.set_exception(exc)
        else:
            command.result.set_result(report)

    @staticmethod
    def _list_kv_blocks(engine: LLMEngine, command: _ListKVBlocks) -> None:
        try:
            command.result.set_result(engine.kv_block_hashes())
        except Exception as exc:  # KVEventsDisabled, or a bug: the caller reads it
            command.result.set_exception(exc)

    def _add(self, engine: LLMEngine, admitted: AdmittedRequest) -> None:
        request = admitted.request
        try:
            engine.add_admitted(admitted)
        except Exception as exc:  # the scheduler's asserts: fail this request, keep serving
            logger.exception("rejected request %s", request.request_id)
            self._deliver(
                [
                    RequestOutput(
                        request_id=request.request_id,
                        outputs=[],
                        finished=True,
                        num_prompt_tokens=len(request.prompt_token_ids),
                        error=f"{type(exc).__name__}: {exc}",
                    )
                ]
            )

    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats | None = None) -> None:
        if self._loop is None or (not outputs and stats is None):
            return
        self._loop.call_soon_threadsafe(self._dispatch, outputs, stats)

    def _dispatch(self, outputs: list[RequestOutput], stats: EngineStats | None) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
        if stats is not None and stats is not self._stats:
            self._stats = stats
            for listener in self._stats_listeners:
                try:
                    listener(stats)
                except Exception:  # a broken reader must not stop the outputs
                    logger.exception("stats listener failed")
