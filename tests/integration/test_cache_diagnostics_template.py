"""cache_diagnostics on a server whose chat template rewrites history: a real `kvshare serve
--chat-template FILE` (embedded SmolLM2), the official SDK reading model_extra.

The template drops the content of every assistant message before the last user message (as
templates that strip earlier reasoning do), so a chat's second turn cannot reuse the first
turn's answer from the cache: its diagnostics say template_rewrites_history with the index of
the rewritten message, and the start check's gauge reads 0.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.integration.server import running_server, scrape

pytestmark = pytest.mark.integration

DROPS_EARLIER_ANSWERS = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user %}"
    "{%- set content = '' %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
FIRST_TURN = [
    {"role": "system", "content": "You answer questions about the solar system."},
    {"role": "user", "content": "Which planet is the largest one of them all?"},
]
NUM_ANSWER_TOKENS = 32  # the answer fills a block past the prompt, so the tree holds it


@pytest.fixture(scope="module")
def base_url(tmp_path_factory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "drops_earlier_answers.jinja"
    template.write_text(DROPS_EARLIER_ANSWERS, encoding="utf-8")
    with running_server("--chat-template", str(template)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_the_start_check_names_the_template_not_append_only(base_url):
    assert scrape(base_url)["kvshare_chat_template_append_only"] == 0.0


def test_the_second_turn_reads_template_rewrites_history(client):
    model = client.models.list().data[0].id
    extra = {"cache_diagnostics": True, "cache_salt": "history", "ignore_eos": True}
    first = client.chat.completions.create(
        model=model,
        messages=FIRST_TURN,
        max_tokens=NUM_ANSWER_TOKENS,
        temperature=0.0,
        extra_body=extra,
    )
    answer = first.choices[0].message.content
    assert first.usage.completion_tokens == NUM_ANSWER_TOKENS and answer
    second_turn = [
        *FIRST_TURN,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And which one is the smallest of them?"},
    ]
    second = client.chat.completions.create(
        model=model, messages=second_turn, max_tokens=1, temperature=0.0, extra_body=extra
    )
    diagnostics = second.model_extra["cache_diagnostics"]
    assert diagnostics["reason"] == "template_rewrites_history"
    assert diagnostics["rewritten_message_index"] == 2
    assert diagnostics["segment"] == {"kind": "message", "message_index": 2, "role": "assistant"}
    # The first turn's prompt is reused to its last token; the answer after it is not,
    # because the template renders the answer as empty now.
    assert diagnostics["first_miss_index"] == first.usage.prompt_tokens
    assert diagnostics["text_before"].endswith("assistant\n")
    assert "And which one" in diagnostics["text_at"]  # the answer's content is gone
