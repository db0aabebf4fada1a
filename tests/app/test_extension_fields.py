"""vLLM / SGLang extension fields: what routers (sglang-router) and their clients send.

Honoured fields change what they should; fields kvshare cannot honour are accepted only at
their no-op value and refused with a 400 naming them otherwise; unknown fields stay a 400.
"""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from helpers import MODEL, chat_body, sse_chunks, streamed_text
from tiny_tokenizer import FAKE_TEXTS

from engine.core.protocol import FinishReason
from engine.core.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# What sglang-router 0.3.2 (cache_aware) forwards for a plain client request (captured).
GATEWAY_CHAT = {
    "messages": USER,
    "model": MODEL,
    "logprobs": False,
    "max_completion_tokens": 5,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
GATEWAY_COMPLETION = {
    "model": MODEL,
    "prompt": "hi",
    "max_tokens": 5,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def assert_error(response, status: int, param: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    return error


async def content(client, **fields: object) -> str:
    response = await client.post(CHAT, json=chat_body(**fields))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# -- what the gateway forwards ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [(CHAT, GATEWAY_CHAT), (COMPLETIONS, GATEWAY_COMPLETION)]
)
async def test_the_gateways_default_fields_are_accepted(client, engine, path, body) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5  # max_completion_tokens honoured
    assert engine.requests[0].sampling_params == SamplingParams(max_tokens=5)


# -- honoured fields -----------------------------------------------------------------------------


async def test_no_stop_trim_keeps_the_matched_stop_string(client) -> None:
    cut = FAKE_TEXTS[0].index("lazy")
    assert await content(client, stop=["lazy"]) == FAKE_TEXTS[0][:cut]
    assert await content(client, stop=["lazy"], no_stop_trim=False) == FAKE_TEXTS[0][:cut]
    kept = FAKE_TEXTS[0][: cut + len("lazy")]
    assert await content(client, stop=["lazy"], no_stop_trim=True) == kept
    assert await content(client, stop=["lazy"], include_stop_str_in_output=True) == kept


async def test_no_stop_trim_streams_the_same_text(client) -> None:
    body = chat_body(stop=["lazy"], no_stop_trim=True, stream=True)
    response = await client.post(CHAT, json=body)
    assert streamed_text(sse_chunks(response.text)).endswith("the lazy")


async def test_no_stop_trim_on_completions(client) -> None:
    body = {"prompt": "hi", "stop": ["brown"], "no_stop_trim": True}
    response = await client.post(COMPLETIONS, json=body)
    assert response.json()["choices"][0]["text"].endswith("quick brown")


def script_with_special_token(engine: FakeEngine):
    """A script whose text has <|im_start|> in the middle, then EOS."""
    hello = engine.tokenizer.encode("Hello", False)
    special = engine.tokenizer.token_to_id("<|im_start|>")
    ids = [*hello, special, *hello, engine.eos_token_id]
    return lambda params, index: (ids, FinishReason.STOP, engine.eos_token_id)


async def test_skip_special_tokens_false_keeps_them_in_the_text(client, engine) -> None:
    engine.script = script_with_special_token(engine)
    assert await content(client) == "HelloHello"
    assert await content(client, skip_special_tokens=True) == "HelloHello"
    # The EOS that ends the choice is trimmed like a stop string (SGLang's default) ...
    assert await content(client, skip_special_tokens=False) == "Hello<|im_start|>Hello"
    # ... and kept with no_stop_trim.
    kept = await content(client, skip_special_tokens=False, no_stop_trim=True)
    assert kept == "Hello<|im_start|>Hello<|im_end|>"
    response = await client.post(CHAT, json=chat_body(skip_special_tokens=False, stream=True))
    assert streamed_text(sse_chunks(response.text)) == "Hello<|im_start|>Hello"


async def test_skip_special_tokens_false_still_counts_the_stop_token(client, engine) -> None:
    engine.script = script_with_special_token(engine)
    response = await client.post(CHAT, json=chat_body(skip_special_tokens=False))
    num_tokens = len(engine.tokenizer.encode("Hello", False)) * 2 + 2
    assert response.json()["usage"]["completion_tokens"] == num_tokens


def test_detokenizer_keeps_special_tokens_and_stop_strings_when_asked(engine) -> None:
    tokenizer = engine.tokenizer
    ids = [*tokenizer.encode("Hello", False), tokenizer.token_to_id("<|im_start|>")]
    ids += tokenizer.encode(" world!", False)
    plain = IncrementalDetokenizer(tokenizer)
    assert plain.feed(ids) + plain.finish() == "Hello world!"
    special = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert special.feed(ids) + special.finish() == "Hello<|im_start|> world!"
    trimmed = IncrementalDetokenizer(tokenizer, stop=["wor"])
    kept = IncrementalDetokenizer(tokenizer, stop=["wor"], include_stop=True)
    assert trimmed.feed(ids) == "Hello "
    assert kept.feed(ids) == "Hello wor"
    assert kept.stop_string == "wor" and kept.finish() == ""


CONTINUED = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "The answer is"},
]


async def test_continue_final_message_leaves_the_last_message_open(client, engine) -> None:
    response = await client.post(
        CHAT, json=chat_body(continue_final_message=True) | {"messages": CONTINUED}
    )
    assert response.status_code == 200, response.text
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is"
    assert engine.requests[0].prompt_token_ids == engine.tokenizer.encode(prompt, False)
    assert engine.tokenizer.render_chat(CONTINUED, continue_final_message=True) == prompt


async def test_continue_final_message_false_closes_it_and_prompts_anew(client, engine) -> None:
    body = chat_body(continue_final_message=False) | {"messages": CONTINUED}
    assert (await client.post(CHAT, json=body)).status_code == 200
    expected = engine.tokenizer.apply_chat_template(CONTINUED)
    assert engine.requests[0].prompt_token_ids == expected
    assert engine.tokenizer.decode(expected, False).endswith("<|im_start|>assistant\n")


async def test_add_generation_prompt_false_ends_after_the_last_message(client, engine) -> None:
    body = chat_body(add_generation_prompt=False) | {"messages": CONTINUED}
    assert (await client.post(CHAT, json=body)).status_code == 200
    expected = engine.tokenizer.apply_chat_template(CONTINUED, add_generation_prompt=False)
    assert engine.requests[0].prompt_token_ids == expected
    assert engine.tokenizer.decode(expected, False).endswith("The answer is<|im_end|>\n")


@pytest.mark.parametrize(
    "body",
    [
        chat_body(continue_final_message=True),  # the last message is the user's
        chat_body(continue_final_message=True, add_generation_prompt=True)
        | {"messages": CONTINUED},
    ],
    ids=["last-is-user", "with-generation-prompt"],
)
async def test_continue_final_message_refusals_name_it(client, engine, body) -> None:
    response = await client.post(CHAT, json=body)
    assert_error(response, 400, "continue_final_message")
    assert engine.requests == []


# -- accepted only at their no-op value ----------------------------------------------------------

NO_OP_FIELDS = [
    ("return_hidden_states", False, True),
    ("lora_path", None, "adapter-a"),
    ("rid", None, "my-request"),
    ("session_params", None, {"id": "s1"}),
    ("regex", None, "[a-z]+"),
    ("ebnf", None, 'root ::= "a"'),
    ("json_schema", None, '{"type": "object"}'),
]


@pytest.mark.parametrize(("field", "no_op", "other"), NO_OP_FIELDS)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_no_op_fields_are_accepted_at_their_default_only(
    client, engine, path, field, no_op, other
) -> None:
    base = chat_body() if path == CHAT else {"prompt": "hi"}
    accepted = await client.post(path, json=base | {field: no_op})
    assert accepted.status_code == 200, accepted.text
    refused = await client.post(path, json=base | {field: other})
    error = assert_error(refused, 400, field)
    assert field in error["message"]
    assert len(engine.requests) == 1


@pytest.mark.parametrize("field", ["separate_reasoning", "stream_reasoning"])
@pytest.mark.parametrize("value", [True, False])
async def test_reasoning_fields_change_nothing_without_a_reasoning_parser(
    client, field, value
) -> None:
    assert await content(client, **{field: value}) == FAKE_TEXTS[0]


# -- still refused -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, chat_body(no_such_field=1), "no_such_field"),
        (CHAT, chat_body(return_text_in_logprobs=True), "return_text_in_logprobs"),
        (COMPLETIONS, {"prompt": "hi", "continue_final_message": False}, "continue_final_message"),
        (COMPLETIONS, {"prompt": "hi", "separate_reasoning": True}, "separate_reasoning"),
    ],
)
async def test_fields_nobody_defines_here_stay_a_400(client, engine, path, body, field) -> None:
    error = assert_error(await client.post(path, json=body), 400, field)
    assert error["message"] == f"Unrecognized request argument supplied: {field}"
    assert engine.requests == []
