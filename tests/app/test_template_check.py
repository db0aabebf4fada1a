"""The append-only check of chat templates (app/diagnostics/template_check.py) on the tiny
tokenizer, and the diagnostics it changes: exact message indices."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_settings, open_client
from tiny_tokenizer import build_tiny_tokenizer

from app.diagnostics.cache import DiagnosticsContext, chat_segments
from app.diagnostics.template_check import check_chat_template, first_rewritten_message
from app.metrics import ServerMetrics
from app.settings import SettingsError, load_settings
from engine.core.protocol import CacheDiagnosis
from engine.tokenizer import Tokenizer

# ChatML that drops the reasoning of earlier answers (as reasoning models' templates do).
STRIPPING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def stripping(tmp_path_factory) -> Tokenizer:
    path = build_tiny_tokenizer(tmp_path_factory.mktemp("strip"), STRIPPING_TEMPLATE)
    return Tokenizer(path)


def test_chatml_is_append_only(tokenizer_dir: Path) -> None:
    metrics = ServerMetrics()
    assert check_chat_template(Tokenizer(tokenizer_dir), metrics) is None
    assert b"kvshare_chat_template_append_only 1.0" in metrics.render()


def test_a_template_that_strips_reasoning_is_named_with_the_message(stripping, caplog) -> None:
    # system 0, user 1, assistant 2: the answer loses its <think> in the next turn.
    assert first_rewritten_message(stripping) == 2
    metrics = ServerMetrics()
    assert check_chat_template(stripping, metrics) == 2
    assert b"kvshare_chat_template_append_only 0.0" in metrics.render()
    assert "not append-only" in caplog.text and "message 2" in caplog.text


def test_a_diverged_history_reads_template_rewrites_history(stripping) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "<think>hm</think>Hi"},
        {"role": "user", "content": "Bye"},
    ]
    ids = stripping.apply_chat_template(messages)
    segments = chat_segments(stripping, messages, None)
    miss = segments[2].start + 3  # inside the assistant message
    context = DiagnosticsContext(ids, segments, template_rewrites_history=True)
    out = context.to_json(CacheDiagnosis(len(ids), miss, 16, miss, "diverged"), stripping, False)
    assert (out["reason"], out["rewritten_message_index"]) == ("template_rewrites_history", 2)
    before = segments[1].start + 1  # a miss in the first user message is no rewrite
    diagnosis = CacheDiagnosis(len(ids), before, 16, before, "diverged")
    out = context.to_json(diagnosis, stripping, False)
    assert out["reason"] == "diverged"


@pytest.mark.anyio
async def test_server_chat_template_replaces_the_models_own(engine, tmp_path) -> None:
    template_file = tmp_path / "strip.jinja"
    template_file.write_text(STRIPPING_TEMPLATE, encoding="utf-8")
    async with open_client(engine, make_settings(chat_template=str(template_file))) as client:
        assert client.app.state.kvshare.serving.model.tokenizer.chat_template == STRIPPING_TEMPLATE
        metrics = (await client.get("/metrics")).text
    assert "kvshare_chat_template_append_only 0.0" in metrics


def test_a_missing_chat_template_file_is_refused_naming_the_key(tmp_path) -> None:
    with pytest.raises(SettingsError, match=r"server\.chat_template: .*no chat template file"):
        load_settings(None, {}, {"chat_template": str(tmp_path / "missing.jinja")})
