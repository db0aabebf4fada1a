"""HTTP-free services: OpenAI requests -> EngineRequests, engine outputs -> responses/chunks.

One logic serves streaming and non-streaming: run() turns engine outputs into ChoiceDeltas
(incremental detokenization, stop strings, per-choice aborts) and the formatters in
app/formatting.py make chunks of each delta, or fold all of them into one response. So the
streamed and the non-streamed text always agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio

from app.cache_diagnostics import (
    DiagnosticsContext,
    RecentPrompt,
    RecentPrompts,
    Scope,
    Segment,
    chat_segments,
    make_context,
    wants_diagnostics,
)
from app.errors import APIError, EngineError, api_error
from app.formatting import (
    ChatFormatter,
    ChoiceDelta,
    CompletionFormatter,
    Formatter,
    echoed_prompt,
)
from app.limits import RequestLimits
from app.metrics import ServerMetrics
from app.request_models import ChatCompletionRequest, CompletionRequest
from app.response_models import Usage
from app.responses_chain import chained_prompt
from app.settings import ServerSettings
from app.streaming import merge, sse_event
from app.template_check import check_chat_template
from app.tenant_load import TenantGate, TenantLoads, TenantTicket
from app.tool_calls import ToolCallMode, ToolCallParser
from engine.core.errors import KVShareError
from engine.core.protocol import (
    CacheDiagnosis,
    CompletionOutput,
    EngineClient,
    EngineRequest,
    FinishReason,
    ModelInfo,
    RequestOutput,
)
from engine.core.validation import validate_request
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """What the access log line reports about one HTTP request; filled in as it runs."""

    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stored_prompt_tokens: int = 0  # prompt tokens this request added to the prefix cache
    ttft_s: float | None = None
    finish_reason: str | None = None
    prompt: str | None = None  # kept only with log_prompts
    tenant: str | None = None  # set from the API key when keys are configured
    cache_diagnosis: CacheDiagnosis | None = None  # the first prompt's, from the engine
    # Its place in its tenant's load, from admission (check_tenant_limits) to its end; the
    # HTTP request's end releases it too (app/server.py), should run() never start.
    ticket: TenantTicket | None = field(default=None, repr=False)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


def cache_namespace_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt: the tenant (from the API key) narrowed by the request's cache_salt.

    Requests share cached blocks only when both parts are equal; the JSON encoding keeps
    ("a", "b:c") and ("a:b", "c") apart.
    """
    if tenant is None:
        return cache_salt
    return json.dumps([tenant, cache_salt])


def diagnostics_scope(tenant: str | None, cache_salt: str | None) -> Scope:
    """Whose recent prompts a request's cache diagnostics see: its cache namespace (tenant
    and cache_salt), so one salt's prompts are never compared with, nor shown to, another's."""
    return tenant, cache_salt


def scheduling_tenant(tenant: str | None, user: str | None, from_user: bool) -> str | None:
    """The tenant fair share schedules by: the API key's; without keys, with tenant_from_user,
    a hash of the request's `user` field (it narrows no cache namespace); else None (one
    tenant for everyone)."""
    if tenant is not None or not from_user or not user:
        return tenant
    return "user:" + hashlib.sha256(user.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServedModel:
    """The loaded model as the front end sees it."""

    name: str  # the id clients send in `model`
    info: ModelInfo
    tokenizer: Tokenizer

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(f"{self.info.name}:{self.info.weights_version}".encode())
        return "fp_" + digest.hexdigest()[:10]


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: what the template read, and the token ids it rendered to."""

    messages: list[dict[str, Any]]
    template_mode: tuple[bool, bool]  # (add_generation_prompt, continue_final_message)
    tools: list[dict[str, Any]] | None
    token_ids: list[int]


@dataclass
class Prepared:
    """A validated request, tokenized once, ready for the engine."""

    formatter: Formatter
    engine_requests: list[EngineRequest]
    stop: tuple[str, ...]
    include_usage: bool
    skip_special_tokens: bool = True
    keep_stop: bool = False  # no_stop_trim: the matched stop stays in the text
    arrival: float = field(default_factory=time.monotonic)
    diagnostics: DiagnosticsContext | None = None  # asked for cache_diagnostics
    # (scope, response id, prompt): remembered for later diagnostics once admitted
    recent: tuple[Scope, str, RecentPrompt] | None = None

    @classmethod
    def of(
        cls,
        formatter: Formatter,
        engine_requests: list[EngineRequest],
        request: ChatCompletionRequest | CompletionRequest,
    ) -> Prepared:
        return cls(
            formatter,
            engine_requests,
            request.stop_strings,
            request.include_usage,
            skip_special_tokens=request.skips_special_tokens,
            keep_stop=request.keeps_stop,
        )

    @property
    def num_choices(self) -> int:
        return sum(r.sampling_params.n for r in self.engine_requests)


class _Choice:
    """One choice's progress: detokenizer, stop strings, token count, finish reason.

    trim_stop_token: the EOS or stop_token_ids token that ends the choice adds no text
    (SGLang's default once special tokens are kept, skip_special_tokens=false; no_stop_trim
    keeps it). With special tokens skipped the text is as it always was.
    """

    def __init__(
        self, index: int, detokenizer: IncrementalDetokenizer, trim_stop_token: bool = False
    ) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.trim_stop_token = trim_stop_token
        self.finish_reason: str | None = None

    def advance(self, output: CompletionOutput) -> ChoiceDelta:
        delta = ChoiceDelta(self.index)
        logprobs = output.new_logprobs or []
        for position, token_id in enumerate(output.new_token_ids):
            delta.text_offsets.append(self.detokenizer.num_decoded_chars)
            if not self._is_trimmed_stop_token(output, position):
                delta.text += self.detokenizer.feed_token(token_id)
            delta.token_ids.append(token_id)
            if position < len(logprobs):
                delta.logprobs.append(logprobs[position])
            if self.detokenizer.is_stopped:  # later tokens lie beyond the cut
                self.finish_reason = delta.finish_reason = "stop"
                delta.stop_string = self.detokenizer.stop_string
                return delta
        if output.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            delta.text += self.detokenizer.finish()
            self.finish_reason = delta.finish_reason = output.finish_reason.value
        elif output.finish_reason is not None:
            raise EngineError(f"the engine ended choice {self.index} ({output.finish_reason})")
        return delta

    def _is_trimmed_stop_token(self, output: CompletionOutput, position: int) -> bool:
        return (
            self.trim_stop_token
            and output.stop_token_id is not None
            and position == len(output.new_token_ids) - 1
            and output.new_token_ids[position] == output.stop_token_id
        )


class OpenAIServing:
    """Chat and completions over one EngineClient and one loaded model."""

    def __init__(
        self,
        engine: EngineClient,
        model: ServedModel,
        settings: ServerSettings,
        metrics: ServerMetrics,
        limits: RequestLimits | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.settings = settings
        self.metrics = metrics
        self.limits = limits or RequestLimits.of(settings)
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

    # -- request -> EngineRequest(s) ----------------------------------------------------------

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in (self.model.name, self.model.info.name):
            message = (
                f"The model `{requested}` does not exist (this server serves `{self.model.name}`)."
            )
            raise APIError(404, message, param="model", code="model_not_found")

    async def prepare(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        record: RequestRecord,
        prefix_token_ids: list[int] | None = None,
    ) -> Prepared:
        """prepare_chat / prepare_completion in a worker thread: templating and tokenizing a
        body of up to max_body_bytes takes seconds, and the event loop must not wait on it."""
        if isinstance(request, ChatCompletionRequest):
            return await anyio.to_thread.run_sync(
                self.prepare_chat, request, record, prefix_token_ids
            )
        return await anyio.to_thread.run_sync(self.prepare_completion, request, record)

    def prepare_chat(
        self,
        request: ChatCompletionRequest,
        record: RequestRecord,
        prefix_token_ids: list[int] | None = None,
    ) -> Prepared:
        """Validate, apply the chat template, tokenize once. Raises APIError, ParamError or
        ChatTemplateError (400s). Blocking: call it through prepare().

        prefix_token_ids (a chained response's previous prompt and output): the prompt starts
        with exactly these ids when the rendered text starts with their text (chained_prompt)."""
        prompt = self.chat_prompt(request, prefix_token_ids)
        messages, template_mode, tools = prompt.messages, prompt.template_mode, prompt.tools
        prompt_token_ids = prompt.token_ids
        tool_mode = request.tool_mode
        if self.settings.log_prompts:
            record.prompt = self.model.tokenizer.render_chat(messages, *template_mode, tools)
        response_id, engine_requests = self._engine_requests(
            "chatcmpl", [prompt_token_ids], request, record, prompt_param="messages"
        )
        self._check_logprob_size(engine_requests, "top_logprobs" if request.logprobs else None)
        formatter = ChatFormatter(
            **self._formatter_fields(response_id, bool(request.logprobs)),
            tool_calls=ToolCallMode.of(tool_mode),
        )
        prepared = Prepared.of(formatter, engine_requests, request)
        if wants_diagnostics(request.cache_diagnostics, self.settings.cache_diagnostics):
            segments = chat_segments(self.model.tokenizer, messages, tools)
            prepared.diagnostics = self._diagnostics(request, record, prompt_token_ids, segments)
            prepared.diagnostics.template_rewrites_history = self.template_rewrites_at is not None
        scope = diagnostics_scope(record.tenant, request.cache_salt)
        prepared.recent = (scope, response_id, RecentPrompt(prompt_token_ids, messages, tools))
        return prepared

    def chat_prompt(
        self, request: ChatCompletionRequest, prefix_token_ids: list[int] | None = None
    ) -> ChatPrompt:
        """The checked request's prompt as the chat template renders it, tokenized (blocking);
        a chained one starts with prefix_token_ids (see prepare_chat). Raises what
        prepare_chat() raises for the request itself; admits nothing."""
        self.check_model(request.model)
        self.limits.check_chat(request)
        request.check_messages()
        request.tool_mode  # noqa: B018 (checks tools and tool_choice)
        messages = [m.to_template_dict() for m in request.messages]
        template_mode = request.template_mode()  # (add_generation_prompt, continue_final_message)
        tools = request.template_tools()
        token_ids = self._chat_prompt_ids(messages, template_mode, tools, prefix_token_ids)
        return ChatPrompt(messages, template_mode, tools, token_ids)

    def _chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        template_mode: tuple[bool, bool],
        tools: list[dict[str, Any]] | None,
        prefix_token_ids: list[int] | None,
    ) -> list[int]:
        tokenizer = self.model.tokenizer
        if not prefix_token_ids:
            return tokenizer.apply_chat_template(messages, *template_mode, tools=tools)
        text = tokenizer.render_chat(messages, *template_mode, tools)
        return chained_prompt(tokenizer, text, prefix_token_ids)

    def prepare_completion(self, request: CompletionRequest, record: RequestRecord) -> Prepared:
        """Tokenize and validate each prompt; one EngineRequest per prompt (blocking)."""
        self.check_model(request.model)
        self.limits.check_completion(request)
        prompts = self._completion_prompts(request.prompt)
        response_id, engine_requests = self._engine_requests(
            "cmpl", prompts, request, record, prompt_param="prompt"
        )
        self._check_logprob_size(engine_requests, "logprobs")
        with_tokens = bool(request.echo) and request.logprobs is not None  # prompt logprobs
        echoes = [echoed_prompt(self.model.tokenizer, ids, with_tokens) for ids in prompts]
        if self.settings.log_prompts:
            record.prompt = "\n".join(echo.text for echo in echoes)
        formatter = CompletionFormatter(
            **self._formatter_fields(response_id, request.logprobs is not None),
            echo_prompts=echoes if request.echo else None,
            n=engine_requests[0].sampling_params.n,
        )
        prepared = Prepared.of(formatter, engine_requests, request)
        if wants_diagnostics(request.cache_diagnostics, self.settings.cache_diagnostics):
            segments = [Segment(0, "prompt")]
            prepared.diagnostics = self._diagnostics(request, record, prompts[0], segments)
        scope = diagnostics_scope(record.tenant, request.cache_salt)
        prepared.recent = (scope, response_id, RecentPrompt(prompts[0]))
        return prepared

    def _check_logprob_size(self, engine_requests: list[EngineRequest], param: str | None) -> None:
        """A 400 naming `param` when the response's token logprobs would pass the cap."""
        num_entries = 0
        for engine_request in engine_requests:
            params = engine_request.sampling_params
            if params.logprobs is None and params.prompt_logprobs is None:
                continue
            num_tokens = params.max_tokens + (
                len(engine_request.prompt_token_ids) if params.prompt_logprobs is not None else 0
            )
            top = max(params.logprobs or 0, params.prompt_logprobs or 0)
            num_entries += params.n * num_tokens * (top + 1)
        if param is not None:
            self.limits.check_logprob_entries(num_entries, param)

    def _diagnostics(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        record: RequestRecord,
        prompt_token_ids: list[int],
        segments: list[Segment],
    ) -> DiagnosticsContext:
        option = request.cache_diagnostics
        scope = diagnostics_scope(record.tenant, request.cache_salt)
        return make_context(option, self.recent_prompts, scope, prompt_token_ids, segments)

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

    def _formatter_fields(self, response_id: str, want_logprobs: bool) -> dict[str, Any]:
        return {
            "response_id": response_id,
            "model": self.model.name,
            "fingerprint": self.model.fingerprint,
            "tokenizer": self.model.tokenizer,
            "want_logprobs": want_logprobs,
        }

    def _engine_requests(
        self,
        prefix: str,
        prompts: list[list[int]],
        request: ChatCompletionRequest | CompletionRequest,
        record: RequestRecord,
        prompt_param: str,
    ) -> tuple[str, list[EngineRequest]]:
        """A response id and one EngineRequest per prompt (ids suffixed -i when several).

        This is the HTTP edge's one check of each request against the model
        (validate_request): the engine does not check again (see AsyncEngine.generate).
        """
        response_id = f"{prefix}-{secrets.token_hex(12)}"
        cache_salt = cache_namespace_salt(record.tenant, request.cache_salt)
        tenant = scheduling_tenant(record.tenant, request.user, self.settings.tenant_from_user)
        priority = request.priority or 0
        engine_requests = []
        for number, prompt_token_ids in enumerate(prompts):
            max_tokens = self._resolve_max_tokens(len(prompt_token_ids), request, prompt_param)
            params = request.to_sampling_params(max_tokens)
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{number}"
            engine_request = EngineRequest(
                request_id,
                prompt_token_ids,
                params,
                cache_salt=cache_salt,
                tenant=tenant,
                priority=priority,
            )
            validate_request(engine_request, self.model.info, prompt_param=prompt_param)
            engine_requests.append(engine_request)
        return response_id, engine_requests

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """The prompts of a completions request as token ids (none at all -> 400).

        An empty or out-of-vocabulary prompt is refused by validate_request, per prompt.
        """
        items = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [self._prompt_ids(item) for item in items]

    def _prompt_ids(self, item: str | list[int]) -> list[int]:
        if isinstance(item, str):  # "" stays empty (and is refused), never a lone BOS token
            return self.model.tokenizer.encode(item) if item else []
        return list(item)

    def _resolve_max_tokens(
        self,
        num_prompt_tokens: int,
        request: ChatCompletionRequest | CompletionRequest,
        prompt_param: str,
    ) -> int:
        """The requested max_tokens, checked against the context window, or the default.

        Default (max_tokens absent): the room left in the context window, capped at
        settings.default_max_tokens so a forgotten max_tokens cannot hold a slot for the
        whole window. Too long -> 400 with the token counts.
        """
        max_model_len = self.model.info.max_model_len
        room = max_model_len - num_prompt_tokens
        requested = request.requested_max_tokens
        if requested is not None and request.caps_max_tokens:
            requested = min(requested, room) if room >= 1 else None  # None: no room, a 400
        if requested is None:
            if room < 1:
                message = (
                    f"This model's maximum context length is {max_model_len} tokens, and the "
                    f"prompt has {num_prompt_tokens} tokens: no room is left to generate."
                )
                raise APIError(400, message, param=prompt_param, code="context_length_exceeded")
            cap = self.settings.default_max_tokens
            return room if cap is None else min(room, cap)
        if requested > room:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                f"prompt, {requested} for the completion). Please reduce the length of the "
                f"prompt or of the completion."
            )
            param = request.max_tokens_param
            raise APIError(400, message, param=param, code="context_length_exceeded")
        return requested

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
        for engine_request in prepared.engine_requests:
            streams.append(self._drive(prepared, engine_request, base, record))
            base += engine_request.sampling_params.n
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
        self, prepared: Prepared, request: EngineRequest, base_index: int, record: RequestRecord
    ) -> AsyncIterator[ChoiceDelta]:
        """One EngineRequest: feed its outputs to the choices; abort it if left early."""
        trim_stop_token = not (prepared.skip_special_tokens or prepared.keep_stop)
        choices = [
            _Choice(base_index + i, self._detokenizer(request, prepared), trim_stop_token)
            for i in range(request.sampling_params.n)
        ]
        outputs = self.engine.generate(request)
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


def _is_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
