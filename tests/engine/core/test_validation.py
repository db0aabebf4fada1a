"""engine/core/validation.py: the one check of an EngineRequest against the model (no torch)."""

from __future__ import annotations

import pytest

from engine.core.errors import ParamError
from engine.core.protocol import EngineRequest, ModelInfo
from engine.core.sampling_params import SamplingParams
from engine.core.validation import validate_request

INFO = ModelInfo(
    name="m",
    tokenizer_path="-",
    max_model_len=8,
    vocab_size=10,
    eos_token_ids=(2,),
    weights_version="v",
)


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ([], SamplingParams(), "prompt", "prompt must not be empty"),
        ([1, 10], SamplingParams(), "prompt", "token id 10 is outside the vocabulary [0, 10)"),
        ([-1], SamplingParams(), "prompt", "token id -1 is outside the vocabulary [0, 10)"),
        ([1] * 8, SamplingParams(), "prompt", "prompt has 8 tokens but the model's context"),
        ([1], SamplingParams(logit_bias={10: 1.0}), "logit_bias", "logit_bias token id 10"),
        ([1], SamplingParams(stop_token_ids=(11,)), "stop_token_ids", "stop_token_ids token id 11"),
    ],
)
def test_a_request_the_model_cannot_serve_is_refused(prompt, params, param, message) -> None:
    with pytest.raises(ParamError) as info:
        validate_request(EngineRequest("r", prompt, params), INFO)
    assert info.value.param == param
    assert info.value.message.startswith(message)


def test_a_prompt_error_names_the_field_the_caller_says() -> None:
    with pytest.raises(ParamError) as info:
        validate_request(EngineRequest("r", [], SamplingParams()), INFO, prompt_param="messages")
    assert info.value.param == "messages"


def test_a_request_that_fits_passes() -> None:
    params = SamplingParams(logit_bias={9: 1.0}, stop_token_ids=(0,))
    validate_request(EngineRequest("r", [0] * 7, params), INFO)  # one token left to generate
