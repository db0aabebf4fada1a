"""Token counts without generating: POST /v1/responses/input_tokens, /tokenize, /detokenize.

Each counts exactly what the generation routes would feed the engine: input_tokens renders the
Responses request as POST /v1/responses does (to_chat_request after the stored chain that
previous_response_id continues, then the chat template spliced onto the chain's tokens), and
/tokenize (vLLM's shapes) tokenizes a prompt as /v1/completions does or messages as
/v1/chat/completions does. Tenant-free: no cache namespace, no engine admission, no ticket.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from app.openai.request_models import ChatCompletionRequest
from app.openai.request_parts import ChatMessage, RequestModel, Tool
from app.responses.request import ResponseNamedToolChoice, ResponsesRequest, ResponseTextConfig
from app.responses.serving import chain_items, chain_prefix
from app.responses.store import StoredResponse
from app.serving.service import OpenAIServing
from engine.core.errors import ParamError


class InputTokensRequest(RequestModel):
    """The spec's TokenCountsBody: the prompt-shaping fields of a Responses request."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseTextConfig | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    cache_salt: str | None = None  # ours, as on POST /v1/responses: the chain's store scope

    def to_responses_request(self, default_model: str) -> ResponsesRequest:
        given = {name: getattr(self, name) for name in self.model_fields_set - {"model"}}
        return ResponsesRequest(model=self.model or default_model, **given)


class TokenizeRequest(RequestModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    def check_shape(self) -> None:
        """A prompt or messages, and only the options of the one given."""
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt and messages")
        chat_only = ("tools", "add_generation_prompt", "continue_final_message")
        for name in chat_only if self.prompt is not None else ():
            if getattr(self, name) is not None:
                raise ParamError(name, f"{name} goes with messages, not with prompt")
        if self.messages is not None and self.add_special_tokens:
            message = "add_special_tokens goes with prompt (the chat template places them)"
            raise ParamError("add_special_tokens", message)

    def chat_request(self, default_model: str) -> ChatCompletionRequest:
        fields = {
            "tools": self.tools,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        given = {name: value for name, value in fields.items() if value is not None}
        model = self.model or default_model
        return ChatCompletionRequest(model=model, messages=self.messages, **given)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def count_input_tokens(
    serving: OpenAIServing, request: ResponsesRequest, previous: StoredResponse | None
) -> dict[str, Any]:
    """The spec's TokenCountsResource of `request` (body.to_responses_request()) continuing
    `previous` (the stored response its previous_response_id names); blocking (templating),
    so call it in a worker thread. Errors name the chat fields; the route renames them."""
    chat_request = request.to_chat_request(chain_items(previous))
    chat_request.structured  # noqa: B018 (text.format and tool schemas, checked as served)
    num_tokens = len(serving.preparer.chat_prompt(chat_request, chain_prefix(previous)).token_ids)
    return {"object": "response.input_tokens", "input_tokens": num_tokens}


def tokenize(serving: OpenAIServing, body: TokenizeRequest) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens"} (+ "token_strs"), as vLLM answers; blocking."""
    body.check_shape()
    serving.preparer.check_model(body.model)
    tokenizer = serving.model.tokenizer
    if body.prompt is not None:  # as /v1/completions: "" stays empty, never a lone BOS
        add_special_tokens = body.add_special_tokens is not False
        token_ids = tokenizer.encode(body.prompt, add_special_tokens) if body.prompt else []
    else:
        token_ids = serving.preparer.chat_prompt(body.chat_request(serving.model.name)).token_ids
    out: dict[str, Any] = {
        "count": len(token_ids),
        "max_model_len": serving.model.info.max_model_len,
        "tokens": token_ids,
    }
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.token_text(token_id) for token_id in token_ids]
    return out


def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> dict[str, Any]:
    """{"prompt": the text of the tokens}, special tokens kept (the inverse of tokenize)."""
    serving.preparer.check_model(body.model)
    vocab_size = min(serving.model.info.vocab_size, serving.model.tokenizer.vocab_size)
    for number, token_id in enumerate(body.tokens):
        if not 0 <= token_id < vocab_size:
            message = f"tokens[{number}] = {token_id} is not a token id (0 to {vocab_size - 1})"
            raise ParamError(f"tokens[{number}]", message)
    text = serving.model.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return {"prompt": text}
