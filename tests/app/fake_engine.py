"""FakeEngine: an EngineClient with scripted, deterministic outputs and no model.

Choice i of a request emits the tokens of FAKE_TEXTS[(seed + i) % 3] (seed None counts as
0), then EOS, one token per step, honouring max_tokens, min_tokens, ignore_eos (repeat the
text instead of EOS), stop_token_ids and n. It records every request and abort, can fail a
request (RequestOutput.error, or an exception) after some tokens, and can pause requests so
that tests can disconnect at a known point.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

from tiny_tokenizer import FAKE_TEXTS

from engine.core.protocol import (
    AdmittedRequest,
    CompletionOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    ModelInfo,
    RequestOutput,
    StepSample,
    TokenLogprob,
)
from engine.core.sampling_params import SamplingParams
from engine.core.validation import validate_request
from engine.tokenizer import Tokenizer


@dataclass
class Failure:
    after_tokens: int
    message: str
    as_exception: bool = False  # raise instead of RequestOutput.error


def fake_logprob(token_id: int, position: int, num_top: int, vocab_size: int) -> TokenLogprob:
    """Deterministic logprobs: the sampled token first, then its neighbours in the vocab."""
    logprob = -0.25 * (position + 1)
    top = [((token_id + k) % vocab_size, logprob - k) for k in range(num_top)]
    return TokenLogprob(token_id=token_id, logprob=logprob, top_logprobs=top)


class FakeEngine:
    """Implements engine.protocol.EngineClient for tests."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        *,
        name: str = "fake-model",
        max_model_len: int = 256,
        num_cached_tokens: int = 0,
        num_stored_prompt_tokens: int = 0,
    ) -> None:
        self.tokenizer = Tokenizer(tokenizer_path)
        self.eos_token_id = self.tokenizer.eos_token_ids[0]
        self._model_info = ModelInfo(
            name=name,
            tokenizer_path=str(tokenizer_path),
            max_model_len=max_model_len,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            weights_version="fake-v1",
        )
        self.num_cached_tokens = num_cached_tokens
        self.num_stored_prompt_tokens = num_stored_prompt_tokens
        self.ready = True
        self.error_on_load: str | None = None
        self.waiting = 0
        self.started = False
        self.shut_down = False
        self.requests: list[EngineRequest] = []
        self.admissions: list[tuple[str, str]] = []  # (request id, prompt_param) per admit()
        self.aborts: list[tuple[str, int | None]] = []
        self.closed: list[str] = []  # request ids whose generate() iterator ended
        self.failure: Failure | None = None  # applies to every following request
        self.pause_after_tokens: int | None = None
        self.paused = asyncio.Event()  # set when a request reaches the pause point
        self.resume = asyncio.Event()
        self.step_delay_s = 0.0
        self.engine_stats = EngineStats()
        self.stats_listeners: list = []

    # -- EngineClient -------------------------------------------------------------------------

    async def start(self) -> None:
        self.started = True

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def is_ready(self) -> bool:
        return self.ready

    @property
    def num_waiting(self) -> int:
        return self.waiting

    @property
    def load_error(self) -> str | None:
        return self.error_on_load

    def stats(self) -> EngineStats:
        return self.engine_stats

    def add_stats_listener(self, listener) -> None:
        self.stats_listeners.append(listener)

    async def abort(self, request_id: str, choice_index: int | None = None) -> None:
        self.aborts.append((request_id, choice_index))

    async def shutdown(self) -> None:
        self.shut_down = True

    def admit(self, request: EngineRequest, prompt_param: str = "prompt") -> AdmittedRequest:
        """The engine's own check (no grammar: the fake follows no schema)."""
        validate_request(request, self._model_info, prompt_param=prompt_param)
        self.admissions.append((request.request_id, prompt_param))
        return AdmittedRequest(request)

    def generate(self, admitted: AdmittedRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(admitted.request)
        return self._generate(admitted.request)

    # -- scripted generation ------------------------------------------------------------------

    def script(
        self, params: SamplingParams, index: int
    ) -> tuple[list[int], FinishReason, int | None]:
        """Token ids choice `index` will produce, its finish reason and stop token id."""
        seed = params.seed or 0
        text_ids = self.tokenizer.encode(FAKE_TEXTS[(seed + index) % len(FAKE_TEXTS)], False)
        body = list(text_ids)
        while len(body) < params.max_tokens and (
            params.ignore_eos or len(body) < params.min_tokens
        ):
            body += text_ids
        for position, token_id in enumerate(body[: params.max_tokens]):
            if token_id in params.stop_token_ids and position >= params.min_tokens:
                return body[: position + 1], FinishReason.STOP, token_id
        if params.ignore_eos or len(body) >= params.max_tokens:
            return body[: params.max_tokens], FinishReason.LENGTH, None
        return [*body, self.eos_token_id], FinishReason.STOP, self.eos_token_id

    def script_text(self, text: str) -> None:
        """From now on every choice generates `text`, then EOS (cut at max_tokens)."""
        ids = self.tokenizer.encode(text, False)

        def scripted(params: SamplingParams, index: int):
            if len(ids) >= params.max_tokens:
                return ids[: params.max_tokens], FinishReason.LENGTH, None
            return [*ids, self.eos_token_id], FinishReason.STOP, self.eos_token_id

        self.script = scripted  # type: ignore[method-assign]

    def _is_aborted(self, request_id: str, index: int | None) -> bool:
        return (request_id, index) in self.aborts

    async def _generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        params = request.sampling_params
        scripts = [self.script(params, i) for i in range(params.n)]
        done = [False] * params.n
        failure = self.failure
        try:
            if params.max_tokens == 0:  # the prompt only (echo / scoring): no token
                length = FinishReason.LENGTH
                ends = [CompletionOutput(i, [], finish_reason=length) for i in range(params.n)]
                yield self._output(request, ends, finished=True)
                return
            for step in range(max(len(ids) for ids, _, _ in scripts)):
                await self._between_steps(step)
                if self._is_aborted(request.request_id, None):
                    return
                if failure is not None and step == failure.after_tokens:
                    if failure.as_exception:
                        raise RuntimeError(failure.message)
                    yield self._output(request, [], finished=True, error=failure.message)
                    return
                outputs = [self._step(request, scripts[i], i, step, done) for i in range(params.n)]
                outputs = [o for o in outputs if o is not None]
                yield self._output(request, outputs, finished=all(done))
                if all(done):
                    return
        finally:
            self.closed.append(request.request_id)

    async def _between_steps(self, step: int) -> None:
        if self.pause_after_tokens is not None and step == self.pause_after_tokens:
            self.paused.set()
            await self.resume.wait()
        await asyncio.sleep(self.step_delay_s)

    def _step(self, request, script, index, step, done) -> CompletionOutput | None:
        token_ids, finish_reason, stop_token_id = script
        if done[index]:
            return None
        if self._is_aborted(request.request_id, index):
            done[index] = True
            return CompletionOutput(index, [], finish_reason=FinishReason.ABORT)
        token_id = token_ids[step]
        logprobs = None
        if request.sampling_params.logprobs is not None:
            num_top = request.sampling_params.logprobs
            logprobs = [fake_logprob(token_id, step, num_top, self._model_info.vocab_size)]
        output = CompletionOutput(index, [token_id], logprobs)
        if step == len(token_ids) - 1:
            done[index] = True
            output.finish_reason = finish_reason
            output.stop_token_id = stop_token_id
        return output

    def _output(self, request, outputs, finished, error=None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            outputs=outputs,
            finished=finished,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_stored_prompt_tokens=self.num_stored_prompt_tokens,
            error=error,
        )

    def publish(self, stats: EngineStats) -> None:
        """What the engine thread does after a step: hand a snapshot to every listener."""
        self.engine_stats = stats
        for listener in self.stats_listeners:
            listener(stats)

    def publish_steps(self, *samples: StepSample) -> None:
        """One snapshot per step, as AsyncEngine delivers them (figures kept)."""
        for sample in samples:
            per_step = {
                "audit_max_abs_diffs": (),
                "grammar_compile_seconds": (),
                "tier_load_seconds": (),
            }
            self.publish(
                replace(self.engine_stats, step=sample, grammar_mask_seconds=0.0, **per_step)
            )
