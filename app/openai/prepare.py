"""A chat or completions request's preparation: checked, templated and tokenized once into
the EngineRequests and the formatter of its answer (blocking; OpenAIServing.prepare runs it
in a worker thread). The engine checks the result against the model when it admits it."""

from __future__ import annotations

import re
import secrets
from typing import Any

from app.diagnostics.cache import (
    DiagnosticsContext,
    RecentPrompt,
    RecentPrompts,
    Segment,
    chat_segments,
    make_context,
    wants_diagnostics,
)
from app.errors import APIError
from app.openai.chat_format import ChatFormatter
from app.openai.completion_format import CompletionFormatter, echoed_prompt
from app.openai.request_models import ChatCompletionRequest, CompletionRequest
from app.openai.tool_calls import ToolCallMode
from app.responses.chain import chained_prompt
from app.serving.limits import RequestLimits
from app.serving.records import (
    ChatPrompt,
    Prepared,
    RequestRecord,
    ServedModel,
    cache_namespace_salt,
    diagnostics_scope,
    scheduling_tenant,
)
from app.settings import ServerSettings
from engine.core.protocol import AdmittedRequest, EngineClient, EngineRequest
from engine.tokenizer import Tokenizer


class Preparer:
    """Chat and completions requests into Prepared ones, for one model."""

    def __init__(
        self,
        engine: EngineClient,
        model: ServedModel,
        settings: ServerSettings,
        limits: RequestLimits,
        recent_prompts: RecentPrompts,
        template_rewrites_history: bool,
    ) -> None:
        self.engine = engine
        self.model = model
        self.settings = settings
        self.limits = limits
        self.recent_prompts = recent_prompts  # cache_diagnostics.compare_to reads them
        self.template_rewrites_history = template_rewrites_history

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in (self.model.name, self.model.info.name):
            message = (
                f"The model `{requested}` does not exist (this server serves `{self.model.name}`)."
            )
            raise APIError(404, message, param="model", code="model_not_found")

    def prepare_chat(
        self,
        request: ChatCompletionRequest,
        record: RequestRecord,
        prefix_token_ids: list[int] | None = None,
        volatile_line: re.Pattern[str] | None = None,
    ) -> Prepared:
        """Check the fields, apply the chat template, tokenize once, admit. Raises APIError,
        ParamError or ChatTemplateError (400s). Blocking: OpenAIServing.prepare runs it in a
        thread.

        prefix_token_ids (a chained response's previous prompt and output): the prompt starts
        with exactly these ids when the rendered text starts with their text (chained_prompt).
        volatile_line: the system message starts with a line the client changes per request
        (see volatile_prefix_tokens)."""
        prompt = self.chat_prompt(request, prefix_token_ids)
        messages, template_mode, tools = prompt.messages, prompt.template_mode, prompt.tools
        prompt_token_ids = prompt.token_ids
        tool_mode = request.tool_mode
        if self.settings.log_prompts:
            record.prompt = self.model.tokenizer.render_chat(messages, *template_mode, tools)
        num_volatile = 0
        if volatile_line is not None:
            num_volatile = volatile_prefix_tokens(self.model.tokenizer, messages[0], volatile_line)
        response_id, admitted = self._admitted(
            "chatcmpl", [prompt_token_ids], request, record, "messages", num_volatile
        )
        self._check_logprob_size(admitted, "top_logprobs" if request.logprobs else None)
        formatter = ChatFormatter(
            **self._formatter_fields(response_id, bool(request.logprobs)),
            tool_calls=ToolCallMode.of(tool_mode),
        )
        prepared = Prepared.of(formatter, admitted, request)
        if wants_diagnostics(request.cache_diagnostics, self.settings.cache_diagnostics):
            segments = chat_segments(self.model.tokenizer, messages, tools)
            prepared.diagnostics = self._diagnostics(request, record, prompt_token_ids, segments)
            prepared.diagnostics.template_rewrites_history = self.template_rewrites_history
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
        response_id, admitted = self._admitted("cmpl", prompts, request, record, "prompt")
        self._check_logprob_size(admitted, "logprobs")
        with_tokens = bool(request.echo) and request.logprobs is not None  # prompt logprobs
        echoes = [echoed_prompt(self.model.tokenizer, ids, with_tokens) for ids in prompts]
        if self.settings.log_prompts:
            record.prompt = "\n".join(echo.text for echo in echoes)
        formatter = CompletionFormatter(
            **self._formatter_fields(response_id, request.logprobs is not None),
            echo_prompts=echoes if request.echo else None,
            n=admitted[0].request.sampling_params.n,
        )
        prepared = Prepared.of(formatter, admitted, request)
        if wants_diagnostics(request.cache_diagnostics, self.settings.cache_diagnostics):
            segments = [Segment(0, "prompt")]
            prepared.diagnostics = self._diagnostics(request, record, prompts[0], segments)
        scope = diagnostics_scope(record.tenant, request.cache_salt)
        prepared.recent = (scope, response_id, RecentPrompt(prompts[0]))
        return prepared

    def _check_logprob_size(self, admitted: list[AdmittedRequest], param: str | None) -> None:
        """A 400 naming `param` when the response's token logprobs would pass the cap."""
        num_entries = 0
        for engine_request in (one.request for one in admitted):
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

    def _formatter_fields(self, response_id: str, want_logprobs: bool) -> dict[str, Any]:
        return {
            "response_id": response_id,
            "model": self.model.name,
            "fingerprint": self.model.fingerprint,
            "tokenizer": self.model.tokenizer,
            "want_logprobs": want_logprobs,
        }

    def _admitted(
        self,
        prefix: str,
        prompts: list[list[int]],
        request: ChatCompletionRequest | CompletionRequest,
        record: RequestRecord,
        prompt_param: str,
        num_volatile_prefix_tokens: int = 0,
    ) -> tuple[str, list[AdmittedRequest]]:
        """A response id and one EngineRequest per prompt (ids suffixed -i when several), each
        admitted by the engine: its one check against the model (ParamError naming the field,
        `prompt_param` for the prompt) and its grammar's one compile."""
        response_id = f"{prefix}-{secrets.token_hex(12)}"
        cache_salt = cache_namespace_salt(record.tenant, request.cache_salt)
        tenant = scheduling_tenant(record.tenant, request.user, self.settings.tenant_from_user)
        priority = request.priority or 0
        admitted = []
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
                num_volatile_prefix_tokens=num_volatile_prefix_tokens,
            )
            admitted.append(self.engine.admit(engine_request, prompt_param))
        return response_id, admitted

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        """The prompts of a completions request as token ids (none at all -> 400).

        An empty or out-of-vocabulary prompt is refused when the engine admits it, per prompt.
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


def _is_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def volatile_prefix_tokens(
    tokenizer: Tokenizer, system: dict[str, Any], volatile_line: re.Pattern[str]
) -> int:
    """How many prompt tokens a volatile line at the start of the system message spans (to
    the end of its line, as the template renders the message, which the prompt starts with):
    a cache miss inside them is counted as volatile_prefix. 0 without a match."""
    text = tokenizer.render_chat([system], False, False, None)
    match = volatile_line.search(text)
    if match is None:
        return 0
    return len(tokenizer.encode(text[: match.end()], add_special_tokens=False))
