"""response_format end to end: real `kvshare serve` on SmolLM2, the official openai client."""

from __future__ import annotations

import json
from enum import StrEnum

import openai
import pytest
from jsonschema import Draft202012Validator
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

pytestmark = pytest.mark.integration

ASK = [
    {
        "role": "user",
        "content": "Describe the sky in JSON with a colour, whether it is cloudy and a count.",
    }
]


class Colour(StrEnum):
    blue = "blue"
    grey = "grey"
    red = "red"


class Sky(BaseModel):
    colour: Colour
    cloudy: bool
    birds: int


def test_parse_returns_the_pydantic_model(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=ASK, response_format=Sky, temperature=0, max_tokens=96
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Sky)
    Draft202012Validator(to_strict_json_schema(Sky)).validate(json.loads(message.content))
    assert Sky.model_validate_json(message.content) == message.parsed


def test_langchain_with_structured_output_json_schema(server_url, model):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{server_url}/v1", api_key="unused", model=model, temperature=0, max_tokens=96
    )
    structured = llm.with_structured_output(Sky, method="json_schema", include_raw=True)
    result = structured.invoke(ASK[0]["content"])
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Sky)
    raw = json.loads(result["raw"].content)
    Draft202012Validator(to_strict_json_schema(Sky)).validate(raw)
    assert Sky.model_validate(raw) == result["parsed"]


def test_json_object_returns_a_json_object(client, model):
    completion = client.chat.completions.create(
        model=model,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert choice.message.content.lstrip().startswith("{")


def test_streamed_json_schema_equals_non_streamed(client, model):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "sky", "schema": to_strict_json_schema(Sky), "strict": True},
    }
    fields = dict(
        model=model, messages=ASK, response_format=response_format, temperature=0.8, seed=11
    )
    full = client.chat.completions.create(**fields, max_tokens=96)
    chunks = client.chat.completions.create(**fields, max_tokens=96, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == full.choices[0].message.content
    Sky.model_validate_json(streamed)


def test_refused_keyword_is_a_400(client, model):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "tags", "schema": {"type": "array", "uniqueItems": True}},
    }
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model, messages=ASK, response_format=response_format, max_tokens=8
        )
    assert refused.value.body["param"] == "response_format"
    assert "uniqueItems" in refused.value.body["message"]
