"""OpenAIServing: a request prepared and admitted once (app/openai/prepare.py), run in the
engine, its outputs made choice deltas (app/serving/choices.py) and handed to the route as
finished SSE chunks or a finished JSON body.

One logic serves streaming and non-streaming: run() yields the deltas and the formatters
(app/openai/formatting.py's Formatter) make chunks of each, or fold all of them into one
response; so the streamed and the non-streamed text always agree.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from functools import partial

import anyio
from fastapi import Request, Response

from app.diagnostics.cache import RecentPrompts
from app.diagnostics.template_check import check_chat_template
from app.errors import APIError, EngineError, api_error
from app.metrics import ServerMetrics
from app.openai.formatting import ChoiceDelta, Formatter
from app.openai.prepare import Preparer
from app.openai.request_models import ChatCompletionRequest, CompletionRequest
from app.openai.tool_calls import ToolCallParser
from app.serving.choices import Choice
from app.serving.limits import RequestLimits
from app.serving.records import Prepared, RequestRecord, ServedModel, scheduling_tenant
from app.serving.tenant_load import TenantGate, TenantLoads
from app.settings import ServerSettings
from app.streaming import merge, respond, sse_event
from engine.core.errors import KVShareError
from engine.core.protocol import AdmittedRequest, EngineClient, EngineRequest, RequestOutput
from engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class OpenAIServing:
    """Chat and completions over one EngineClient and one loaded model."""

    def __init__(
        self,
        engine: EngineClient,
        model: ServedModel,
        settings: ServerSettings,
        metrics: ServerMetrics,
        limits: RequestLimits | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.settings = settings
        self.metrics = metrics
        self.limits = limits or RequestLimits.of(settings)
        self.stop = stop  # set when the server's drain grace ends: streams end then
        loads = TenantLoads(
            settings.max_running_requests_per_tenant,
            settings.max_waiting_requests_per_tenant,
            settings.max_waiting_prompt_tokens_per_tenant,
        )
        self.tenants = TenantGate(loads, metrics)  # per-tenant limits (docs/fair-scheduling.md)
        self.created = int(time.time())
        # cache_diagnostics.compare_to and GET /debug/cache_report
        self.recent_prompts = RecentPrompts(settings.cache_history_size)
        self.template_rewrites_at = check_chat_template(model.tokenizer, metrics)
        rewrites = self.template_rewrites_at is not None
        recent = self.recent_prompts
        self.preparer = Preparer(engine, model, settings, self.limits, recent, rewrites)

    # -- a request: prepared and admitted, then answered ----------------------------------------

    async def prepare(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        record: RequestRecord,
        prefix_token_ids: list[int] | None = None,
        volatile_line: re.Pattern[str] | None = None,
    ) -> Prepared:
        """The Preparer's work in a worker thread: templating and tokenizing a body of up to
        max_body_bytes takes seconds, a schema's compile as long, and the event loop must not
        wait on them."""
        preparer = self.preparer
        if isinstance(request, ChatCompletionRequest):
            return await anyio.to_thread.run_sync(
                preparer.prepare_chat, request, record, prefix_token_ids, volatile_line
            )
        return await anyio.to_thread.run_sync(preparer.prepare_completion, request, record)

    async def respond(
        self, request: Request, prepared: Prepared, record: RequestRecord, stream: bool
    ) -> Response:
        """Answer a prepared chat or completions request: its SSE chunks, or its JSON body
        once finished (app/streaming.py); a 429 first when its tenant is over a per-tenant
        limit."""
        self.check_tenant_limits(prepared, record)
        return await respond(
            request,
            stream,
            chunks=lambda: self.stream(prepared, record),
            complete=lambda: self.complete(prepared, record),
            keepalive_seconds=self.settings.keepalive_seconds,
            stop=self.stop,
        )

    def diagnostics_json(self, prepared: Prepared, record: RequestRecord) -> dict | None:
        """The cache_diagnostics object of a finished request (None if not asked for)."""
        if prepared.diagnostics is None:
            return None
        has_tenants = bool(self.settings.api_keys)
        out = prepared.diagnostics.to_json(
            record.cache_diagnosis, self.model.tokenizer, has_tenants
        )
        self.metrics.observe_cache_divergence(out.get("segment"))
        return out

    def check_tenant_limits(self, prepared: Prepared, record: RequestRecord) -> None:
        """Admit the request into its tenant's load, or a 429 (TenantLimitExceeded) when the
        tenant is over a per-tenant limit: checked and counted at once, so a burst cannot pass
        the limits before any of it runs. Call it before answering (a stream cannot turn into a
        429 once started); the diagnostics remember the prompt only from here."""
        assert record.ticket is None, "a request is admitted once"
        num_prompt_tokens = sum(len(r.prompt_token_ids) for r in prepared.engine_requests)
        tenant = prepared.engine_requests[0].tenant
        self.tenants.check(tenant, num_prompt_tokens)
        record.ticket = self.tenants.arrive(tenant, num_prompt_tokens, prepared.arrival)
        if prepared.recent is not None:
            self.recent_prompts.remember(*prepared.recent)

    def check_tenant_before_prepare(self, record: RequestRecord, user: str | None) -> None:
        """The limits a request can be refused by before its body is templated: its tenant's
        running and waiting requests (its prompt tokens are not known yet)."""
        tenant = scheduling_tenant(record.tenant, user, self.settings.tenant_from_user)
        self.tenants.check(tenant, 0)

    @contextmanager
    def tenant_slot(self, record: RequestRecord) -> Iterator[None]:
        """A token route's place in its tenant's load while it works (a 429 over a limit):
        counting tokens costs a templating of the whole body, as generating does."""
        self.tenants.check(record.tenant, 0)
        ticket = self.tenants.arrive(record.tenant, 0, time.monotonic())
        try:
            yield
        finally:
            ticket.leave(0)

    # -- engine outputs -> deltas ---------------------------------------------------------------

    async def run(self, prepared: Prepared, record: RequestRecord) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas, in engine order; the choices' last deltas carry a finish reason.

        Raises EngineError when the engine fails the request, and the APIError of
        app/errors.py's table when it refuses it (an engine error type). Leaving early
        (disconnect, cancellation) aborts the engine requests that are still running.
        """
        record.prompt_tokens = sum(len(r.prompt_token_ids) for r in prepared.engine_requests)
        tenant = prepared.engine_requests[0].tenant
        ticket = record.ticket or self.tenants.arrive(
            tenant, record.prompt_tokens, prepared.arrival
        )
        streams, base = [], 0
        for admitted in prepared.admitted:
            streams.append(self._drive(prepared, admitted, base, record))
            base += admitted.request.sampling_params.n
        outcome = "abort"
        try:
            saw_length = False
            # aclosing: leaving at a yield must close the inner generators now (they abort).
            async with aclosing(merge(streams)) as deltas:
                async for delta in deltas:
                    ticket.first_output()
                    record.completion_tokens += len(delta.token_ids)
                    saw_length = saw_length or delta.finish_reason == "length"
                    yield delta
            outcome = "length" if saw_length else "stop"
        except APIError as e:  # EngineError, or an engine error type mapped by api_error()
            outcome = "error" if e.status_code >= 500 else "abort"
            raise
        finally:
            ticket.leave(record.completion_tokens)
            record.finish_reason = outcome
            self.metrics.observe_request(outcome, time.monotonic() - prepared.arrival)

    async def run_content(
        self, prepared: Prepared, record: RequestRecord
    ) -> AsyncIterator[tuple[ChoiceDelta, str]]:
        """run()'s deltas, each with the content the tool-call parser releases as final (the
        delta's text when the request has no tools): what an event stream may send as text."""
        mode = getattr(prepared.formatter, "tool_call_mode", None)
        parser = None if mode is None else ToolCallParser(mode)
        async with aclosing(self.run(prepared, record)) as deltas:
            async for delta in deltas:
                yield delta, (delta.text if parser is None else parser.feed(delta.text))

    async def _drive(
        self,
        prepared: Prepared,
        admitted: AdmittedRequest,
        base_index: int,
        record: RequestRecord,
    ) -> AsyncIterator[ChoiceDelta]:
        """One admitted EngineRequest: feed its outputs to the choices; abort it if left
        early."""
        request = admitted.request
        trim_stop_token = not (prepared.skip_special_tokens or prepared.keep_stop)
        choices = [
            Choice(base_index + i, self._detokenizer(request, prepared), trim_stop_token)
            for i in range(request.sampling_params.n)
        ]
        outputs = self.engine.generate(admitted)
        is_complete = False
        last_token_at: float | None = None
        try:
            async for output in outputs:
                if output.error is not None:
                    raise EngineError(f"The engine failed this request: {output.error}")
                record.cached_tokens = max(record.cached_tokens, output.num_cached_tokens)
                if base_index == 0:
                    record.stored_prompt_tokens = output.num_stored_prompt_tokens
                if base_index == 0 and record.cache_diagnosis is None:
                    record.cache_diagnosis = output.cache_diagnosis
                last_token_at = self._observe_timing(prepared, output, last_token_at, record)
                for completion in output.outputs:
                    choice = choices[completion.index]
                    if choice.finish_reason is not None:
                        continue  # stopped here by a stop string; the engine may lag a step
                    delta = choice.advance(completion)
                    delta.prompt_logprobs = output.prompt_logprobs  # once, with the first
                    if delta.finish_reason == "stop" and choice.detokenizer.is_stopped:
                        await self.engine.abort(request.request_id, completion.index)
                    yield delta
                if all(c.finish_reason is not None for c in choices):
                    is_complete = True
                    break
                if output.finished:
                    break
            if not is_complete:
                raise EngineError("The engine ended the request before every choice finished.")
        except (APIError, anyio.get_cancelled_exc_class(), GeneratorExit):
            raise
        except KVShareError as e:  # the engine refused it (e.g. DuplicateRequest)
            raise api_error(e) from e
        except Exception as e:
            logger.exception("engine failure in request %s", request.request_id)
            raise EngineError(f"The engine failed this request: {e}") from e
        finally:
            with anyio.CancelScope(shield=True):
                if not is_complete:
                    await self.engine.abort(request.request_id)
                aclose = getattr(outputs, "aclose", None)
                if aclose is not None:
                    await aclose()

    def _detokenizer(self, request: EngineRequest, prepared: Prepared) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.model.tokenizer,
            request.prompt_token_ids,
            prepared.stop,
            skip_special_tokens=prepared.skip_special_tokens,
            include_stop=prepared.keep_stop,
        )

    def _observe_timing(
        self,
        prepared: Prepared,
        output: RequestOutput,
        last_token_at: float | None,
        record: RequestRecord,
    ) -> float | None:
        """TTFT on the first token, then the gap per token since the previous output."""
        num_new = max((len(c.new_token_ids) for c in output.outputs), default=0)
        if num_new == 0:
            return last_token_at
        now = time.monotonic()
        if record.ttft_s is None:
            record.ttft_s = now - prepared.arrival
            self.metrics.time_to_first_token.observe(record.ttft_s)
        elif last_token_at is not None:
            self.metrics.inter_token_latency.observe((now - last_token_at) / num_new)
        return now

    # -- deltas -> responses --------------------------------------------------------------------

    async def complete(self, prepared: Prepared, record: RequestRecord) -> bytes:
        """The whole response at once (non-streaming), as a JSON body.

        Built and encoded in a worker thread: its logprobs (an entry per token and top token,
        each named by the tokenizer) take a second or more near max_logprob_entries, and the
        event loop must not wait on them.
        """
        deltas = [delta async for delta in self.run(prepared, record)]
        diagnostics = self.diagnostics_json(prepared, record)
        extra = None if diagnostics is None else {"cache_diagnostics": diagnostics}
        build = prepared.formatter.response_body
        return await anyio.to_thread.run_sync(
            build, prepared.num_choices, deltas, record.usage(), extra
        )

    async def stream(self, prepared: Prepared, record: RequestRecord) -> AsyncIterator[bytes]:
        """The chunks as SSE events; the usage chunk last when include_usage is set. A delta
        whose chunks hold its prompt's logprobs (an echo) is built in a worker thread."""
        formatter, include_usage = prepared.formatter, prepared.include_usage
        for chunk in formatter.opening_chunks(prepared.num_choices):
            yield sse_event(formatter.dump_chunk(chunk, include_usage))
        async with aclosing(self.run(prepared, record)) as deltas:
            async for delta in deltas:
                encode = partial(_chunk_events, formatter, delta, include_usage)
                if formatter.has_prompt_logprobs(delta):
                    events = await anyio.to_thread.run_sync(encode)
                else:
                    events = encode()
                for event in events:
                    yield event
        diagnostics = self.diagnostics_json(prepared, record)
        if include_usage:
            chunk = formatter.dump_chunk(formatter.usage_chunk(record.usage()), True)
            if diagnostics is not None:
                chunk["cache_diagnostics"] = diagnostics
            yield sse_event(chunk)


def _chunk_events(formatter: Formatter, delta: ChoiceDelta, include_usage: bool) -> list[bytes]:
    return [sse_event(formatter.dump_chunk(c, include_usage)) for c in formatter.chunks(delta)]
