"""A request's record and prepared form, and the namespaces it runs in: what the services
of every API pass along (torch-free, no I/O)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from app.diagnostics.cache import DiagnosticsContext, RecentPrompt, Scope
from app.openai.formatting import Formatter
from app.openai.request_models import ChatCompletionRequest, CompletionRequest
from app.openai.response_models import Usage
from app.serving.tenant_load import TenantTicket
from engine.core.protocol import AdmittedRequest, CacheDiagnosis, EngineRequest, ModelInfo
from engine.tokenizer import Tokenizer


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
    # HTTP request's end releases it too (app/middleware.py), should run() never start.
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
    """A request templated and tokenized once, its fields checked, admitted by the engine
    (checked against the model, its grammar compiled): ready to run."""

    formatter: Formatter
    admitted: list[AdmittedRequest]  # one per prompt
    stop: tuple[str, ...]
    include_usage: bool
    skip_special_tokens: bool = True
    keep_stop: bool = False  # no_stop_trim: the matched stop stays in the text
    arrival: float = field(default_factory=time.monotonic)
    diagnostics: DiagnosticsContext | None = None  # asked for cache_diagnostics
    # (scope, response id, prompt): remembered for later diagnostics once its tenant takes it
    recent: tuple[Scope, str, RecentPrompt] | None = None

    @classmethod
    def of(
        cls,
        formatter: Formatter,
        admitted: list[AdmittedRequest],
        request: ChatCompletionRequest | CompletionRequest,
    ) -> Prepared:
        return cls(
            formatter,
            admitted,
            request.stop_strings,
            request.include_usage,
            skip_special_tokens=request.skips_special_tokens,
            keep_stop=request.keeps_stop,
        )

    @property
    def engine_requests(self) -> list[EngineRequest]:
        return [admitted.request for admitted in self.admitted]

    @property
    def num_choices(self) -> int:
        return sum(r.sampling_params.n for r in self.engine_requests)
