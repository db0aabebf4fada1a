"""Function tools end to end: real `kvshare serve` on SmolLM2, the official openai client.

A forced tool_choice ("required" or a named function) is enforced by the grammar, so every
call's arguments must validate against the function's parameters even when sampled at
temperature 1; "auto" may answer in text, but a call it starts is completed under the grammar.
"""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from app.openai.structured_output import MAX_PARALLEL_TOOL_CALLS

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast for a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now.", "parameters": TIME},
    },
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris tomorrow?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(message) -> list[tuple[str, dict]]:
    """Each call's (name, arguments), after validating the arguments against its function."""
    calls = []
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments = json.loads(call.function.arguments)
        Draft202012Validator(PARAMETERS[call.function.name]).validate(arguments)
        calls.append((call.function.name, arguments))
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)
    return calls


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_always_validate(client, model, tool_choice, seed):
    completion = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=128,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    calls = check_calls(choice.message)
    assert len(calls) == 1
    if tool_choice == NAMED:
        assert calls[0][0] == "get_weather"


def test_required_with_parallel_calls_validates(client, model):
    completion = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.7,
        seed=5,
        max_tokens=512,  # room for MAX_PARALLEL_TOOL_CALLS calls: the grammar ends the array
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert 1 <= len(check_calls(choice.message)) <= MAX_PARALLEL_TOOL_CALLS


@pytest.mark.parametrize("seed", [1, 2])
def test_auto_answers_in_text_or_with_valid_calls(client, model, seed):
    completion = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=96
    )
    choice = completion.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        check_calls(choice.message)
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)


def test_streamed_named_call_equals_non_streamed(client, model):
    fields = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0.9, seed=11
    )
    whole = client.chat.completions.create(**fields, max_tokens=128).choices[0]
    names, arguments, finish = {}, {}, None
    for chunk in client.chat.completions.create(**fields, max_tokens=128, stream=True):
        for choice in chunk.choices:
            for part in choice.delta.tool_calls or []:
                if part.function.name:
                    names[part.index] = part.function.name
                arguments[part.index] = arguments.get(part.index, "") + part.function.arguments
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(names[i], arguments[i]) for i in sorted(names)] == [
        (call.function.name, call.function.arguments) for call in whole.message.tool_calls
    ]


def test_history_with_tool_results_is_accepted(client, model):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny, 21 C"}'},
    ]
    completion = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, seed=1
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content


def test_langchain_bind_tools(server_url, model):
    import langchain_openai  # a dev dependency: never skipped

    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server_url}/v1", api_key="unused", model=model, temperature=0, max_tokens=96
    )
    tool = {"type": "function", "function": TOOLS[0]["function"]}
    bound = llm.bind_tools([tool], tool_choice="get_weather")
    reply = bound.invoke("What is the weather like in Paris tomorrow?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather"
    Draft202012Validator(WEATHER).validate(call["args"])


def test_auto_grammar_completes_every_started_call(model_dir):
    """The "tool_calls" constraint of tool_choice "auto", on SmolLM2's tokenizer: free text,
    but a `<tool_call>` must go on as a call whose arguments validate."""
    import xgrammar as xgr

    from app.openai.json_schema import canonical_json
    from engine.core.config import EngineConfig
    from engine.core.protocol import ModelInfo
    from engine.core.sampling_params import StructuredOutput
    from engine.runtime.grammar import GrammarCache
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    info = ModelInfo("smollm2", model_dir, 2048, tokenizer.vocab_size, tokenizer.eos_token_ids, "v")
    cache = GrammarCache(info, EngineConfig())
    listed = [{"name": name, "parameters": schema} for name, schema in PARAMETERS.items()]
    compiled = cache.compile(StructuredOutput("tool_calls", canonical_json(listed)))
    cache.close()

    def accepts(text: str, complete: bool = True) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        ok = all(matcher.accept_token(t) for t in tokenizer.encode(text, False))
        return ok and (not complete or matcher.accept_token(tokenizer.eos_token_ids[0]))

    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    assert accepts("It is sunny.")
    assert accepts(f"Let me look.{call} Done.")
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert not accepts('<tool_call>\n{"name": "get_date"', complete=False)
    assert not accepts(call[: len(call) - 5])  # a started call cannot end the output
