"""The one check of an EngineRequest against the model that will serve it (torch-free).

Called once per request, by the engine's admit() (LLMEngine.admit: for HTTP from the worker
thread that prepares the request, after it has resolved max_tokens; offline from
LLMEngine.add_request and generate); generate() runs only what admit() returned.
SamplingParams checks its own fields when it is built; what needs the model (context window,
vocabulary) is checked here.
"""

from __future__ import annotations

from engine.core.errors import ParamError
from engine.core.protocol import EngineRequest, ModelInfo


def validate_request(
    request: EngineRequest, model_info: ModelInfo, *, prompt_param: str = "prompt"
) -> None:
    """Raise ParamError naming the field when the engine cannot serve `request`.

    `prompt_param` is the field reported for a bad prompt (chat reports "messages").
    """
    prompt = request.prompt_token_ids
    if not prompt:
        raise ParamError(prompt_param, "prompt must not be empty")
    vocab_size = model_info.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError(
            prompt_param, f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )
    if len(prompt) >= model_info.max_model_len:
        raise ParamError(
            prompt_param,
            f"prompt has {len(prompt)} tokens but the model's context window is "
            f"{model_info.max_model_len} tokens (at least one must be left to generate)",
        )
    request.sampling_params.check_token_ids(vocab_size)
