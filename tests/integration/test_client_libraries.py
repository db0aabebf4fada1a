"""The client libraries people put on an OpenAI-compatible server, as test drivers against a
real `kvshare serve` of the embedded default: instructor, pydantic-ai, the OpenAI Agents SDK
and litellm. Their pydantic models nest (pydantic sends them as `$defs` + `$ref`), hold enums
and lists, and list their fields in an order that is not sorted. The tiny model's values may be
odd; what the grammar guarantees is checked: output that validates, keys in field order."""

from __future__ import annotations

import asyncio
import enum
import json
import os
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.app.schema_walk import check_key_order

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from GitHub at import

pytestmark = pytest.mark.integration
MAX_TOKENS = 200


class Color(enum.StrEnum):
    red = "red"
    blue = "blue"


class City(BaseModel):
    zip_code: int = Field(ge=0, le=99999)
    name: str = Field(max_length=12)


class Person(BaseModel):
    """A person (nested model, enum, list; fields deliberately not in sorted order)."""

    surname: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    home: City
    colors: list[Color] = Field(max_length=3)


SCHEMA = Person.model_json_schema()
ASK = "Describe a person who lives in Paris."


def _check_json(text: str) -> Person:
    """text parses as a Person whose objects list their keys in field order."""
    instance = json.loads(text)
    check_key_order(instance, SCHEMA, SCHEMA)
    return Person.model_validate(instance)


def test_pydantic_puts_nested_models_under_defs():
    """The shape that broke forced tool calls: refs to root-level $defs."""
    assert set(SCHEMA["$defs"]) == {"City", "Color"}
    assert SCHEMA["properties"]["home"] == {"$ref": "#/$defs/City"}


@pytest.mark.parametrize("mode_name", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(server_url, model, mode_name):
    import instructor

    raw = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode_name))
    person, completion = client.chat.completions.create_with_completion(
        model=model,
        response_model=Person,
        messages=[{"role": "user", "content": ASK}],
        max_tokens=MAX_TOKENS,
        max_retries=0,
        seed=1,
    )
    message = completion.choices[0].message
    if mode_name == "TOOLS":
        (call,) = message.tool_calls
        assert call.function.name == "Person"
        text = call.function.arguments
    else:
        text = message.content
    _check_json(text)  # what the server wrote; instructor's own parse of it:
    assert isinstance(person, Person)


def _pydantic_ai_model(server_url: str, model: str):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{server_url}/v1", api_key="unused")
    return OpenAIChatModel(model, provider=provider)


def _pydantic_ai_tool_texts(result) -> list[tuple[str, str]]:
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    return [
        (part.tool_name, part.args if isinstance(part.args, str) else json.dumps(part.args))
        for message in result.all_messages()
        if isinstance(message, ModelResponse)
        for part in message.parts
        if isinstance(part, ToolCallPart)
    ]


class Place(BaseModel):
    city: Literal["Paris", "Rome"]
    color: Color


class Visitor(BaseModel):
    """Nested, fields not sorted, every value an enum: pydantic-ai's strict tool schema drops
    maxLength and numeric bounds, so free strings or numbers would let the tiny model run past
    max_tokens inside one value; enums bound the output whatever the model does."""

    name: Literal["Ann", "Bob"]
    home: Place
    favourite: Color


def test_pydantic_ai_output_type_with_nested_model(server_url, model):
    """pydantic-ai's final_result tool (strict, tool_choice required) with a nested model."""
    from pydantic_ai import Agent

    agent = Agent(_pydantic_ai_model(server_url, model), output_type=Visitor, retries=0)
    result = agent.run_sync(ASK, model_settings={"max_tokens": MAX_TOKENS, "seed": 1})
    assert isinstance(result.output, Visitor)
    (final,) = [text for name, text in _pydantic_ai_tool_texts(result) if name == "final_result"]
    schema = Visitor.model_json_schema()
    assert "$defs" in schema  # the nested model goes out as a $ref
    instance = json.loads(final)
    check_key_order(instance, schema, schema)
    Visitor.model_validate(instance)


def test_pydantic_ai_with_a_tool(server_url, model):
    from pydantic_ai import Agent

    agent = Agent(_pydantic_ai_model(server_url, model), output_type=Person, retries=0)
    seen: list[City] = []

    @agent.tool_plain
    def lookup_city(city: City) -> str:
        """Look a city up by its zip code."""
        seen.append(city)
        return "found"

    result = agent.run_sync(ASK, model_settings={"max_tokens": MAX_TOKENS, "seed": 2})
    assert isinstance(result.output, Person)
    calls = _pydantic_ai_tool_texts(result)
    assert {name for name, _ in calls} <= {"final_result", "lookup_city"}
    assert len(seen) == sum(name == "lookup_city" for name, _ in calls)
    city_schema = City.model_json_schema()
    for name, text in calls:
        if name == "lookup_city":
            check_key_order(json.loads(text)["city"], city_schema, city_schema)


def test_agents_sdk_with_a_function_tool(server_url, model):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    received: list[Person] = []

    @function_tool
    def register(person: Person) -> str:
        """Register a person."""
        received.append(person)
        return f"registered {person.surname}"

    client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="clerk",
        instructions="Register the person the user describes.",
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        tools=[register],
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, ASK, max_turns=2))
    assert len(received) == 1
    assert result.final_output == f"registered {received[0].surname}"


def test_litellm_openai_provider_with_pydantic_response_format(server_url, model):
    import litellm

    response = litellm.completion(
        model=f"openai/{model}",
        api_base=f"{server_url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": ASK}],
        response_format=Person,
        max_tokens=MAX_TOKENS,
        seed=3,
    )
    _check_json(response.choices[0].message.content)


def test_schema_the_compiler_refuses_is_a_clean_400(server_url, model):
    """Accepted by the edge's checker, refused by xgrammar: the same clean 400, naming the tool."""
    bad = {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 1}},
    }
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": ASK}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
        "tool_choice": "required",
    }
    response = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert ".cc" not in error["message"] and "/project" not in error["message"], error
