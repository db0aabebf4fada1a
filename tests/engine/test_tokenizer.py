"""engine/tokenizer.py against transformers (allowed in tests) and against full decodes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tests.app.tiny_tokenizer import FAKE_TEXTS, build_tiny_tokenizer

RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(found=false) -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.found = true -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if not ns.found -%}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}\n"
    "  {%- if m.role not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('bad role ' ~ m.role) }}{%- endif %}\n"
    "<|im_start|>{{ m.role }}\n{{ m.content | trim }}"
    "{% if m.name is defined %} {{ m.name | tojson }}{% endif %}<|im_end|>"
    "{{ '\n' if not loop.last else '' }}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": '你好 🙂 "quoted"\nsecond line'},
        {"role": "assistant", "content": "  Bonjour  "},
        {"role": "user", "content": "again", "name": 'ünïcode "name"'},
    ],
    [{"role": "user", "content": "no name", "name": None}],
]


@pytest.fixture(scope="module", params=["chatml", "rich"])
def tokenizer_dir(request, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp(f"tok-{request.param}")
    if request.param == "chatml":
        return build_tiny_tokenizer(directory)
    return build_tiny_tokenizer(directory, chat_template=RICH_TEMPLATE)


@pytest.fixture(scope="module")
def ours(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def theirs(tokenizer_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, conversation, add_generation_prompt):
    text = ours.render_chat(conversation, add_generation_prompt)
    expected = theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    ids = ours.apply_chat_template(conversation, add_generation_prompt)
    expected_ids = theirs.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert ids == list(expected_ids)


@pytest.mark.parametrize("text", [*FAKE_TEXTS, "", "<|im_start|>user\nhi<|im_end|>", " 龘  x"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_transformers(ours, theirs, text, add_special_tokens) -> None:
    ids = ours.encode(text, add_special_tokens)
    assert ids == theirs.encode(text, add_special_tokens=add_special_tokens)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, False) == theirs.decode(ids, skip_special_tokens=False)


def test_special_tokens_and_sizes(ours, theirs) -> None:
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    assert ours.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }


def test_token_bytes_rebuild_the_text(ours) -> None:
    for text in FAKE_TEXTS:
        ids = ours.encode(text, False)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
    end = ours.token_to_id("<|im_end|>")
    assert ours.token_bytes(end) == b"<|im_end|>"
    assert ours.token_text(ours.encode("龘", False)[0]) == "\ufffd"


def test_template_errors_are_chat_template_errors(tmp_path: Path) -> None:
    tokenizer = Tokenizer(build_tiny_tokenizer(tmp_path / "t", chat_template=RICH_TEMPLATE))
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        tokenizer.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tokenizer.render_chat([])
    config_path = tmp_path / "t" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tmp_path / "t").render_chat([{"role": "user", "content": "x"}])


def test_chat_template_file_and_generation_config(tmp_path: Path) -> None:
    directory = build_tiny_tokenizer(tmp_path / "t")
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tokenizer = Tokenizer(directory)
    assert tokenizer.render_chat([{"role": "user", "content": "x"}]) == "x!"
    assert tokenizer.eos_token_ids == (2, 0)  # tokenizer_config's eos first


GEMMA_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
]


@pytest.fixture
def gemma_without_template(tmp_path: Path) -> Tokenizer:
    """A tokenizer directory with no chat template, beside a Gemma 3 config.json."""
    directory = build_tiny_tokenizer(tmp_path / "t")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    return Tokenizer(directory)


def test_a_gemma_checkpoint_without_a_template_gets_gemmas_turns(gemma_without_template):
    bos = gemma_without_template.special_tokens["bos_token"]
    assert gemma_without_template.render_chat(GEMMA_CHAT) == (
        f"{bos}<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_gemma_turns_extend_the_previous_turns_text(gemma_without_template):
    """Turn N + 1 renders as turn N, its answer and its end marker, then the new turn: what
    a multi-turn chat needs to hit the prefix cache."""
    first = gemma_without_template.render_chat(GEMMA_CHAT[:2])
    second = gemma_without_template.render_chat(GEMMA_CHAT)
    assert second.startswith(first + "Hello!<end_of_turn>\n")


def test_gemma_turns_refuse_a_system_message_no_user_turn_follows(gemma_without_template):
    with pytest.raises(ChatTemplateError, match="followed by a user message"):
        gemma_without_template.render_chat([*GEMMA_CHAT, {"role": "system", "content": "x"}])


# -- incremental detokenization ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer(tmp_path_factory.mktemp("tiny")))


def stream(tokenizer: Tokenizer, text: str, stop=(), prompt=()) -> tuple[list[str], str, object]:
    """Feed `text`'s tokens one at a time; (pieces from feed, piece from finish, detokenizer)."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), stop)
    pieces = [detokenizer.feed([token_id]) for token_id in tokenizer.encode(text, False)]
    return pieces, detokenizer.finish(), detokenizer


TEXT_ALPHABET = st.sampled_from([*"ab xyz.!\n", "你", "好", "🙂", "龘", "𝄞", "☃", "é"])


@settings(max_examples=150, deadline=None)
@given(st.lists(TEXT_ALPHABET, max_size=40).map("".join))
def test_incremental_equals_full_decode_and_never_splits_a_char(tiny, text: str) -> None:
    pieces, tail, detokenizer = stream(tiny, text)
    assert "".join(pieces) + tail == tiny.decode(tiny.encode(text, False)) == text
    assert not any("\ufffd" in piece for piece in [*pieces, tail])
    assert detokenizer.text == text
    assert detokenizer.num_decoded_chars == len(text)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(TEXT_ALPHABET, max_size=30).map("".join),
    st.lists(st.lists(TEXT_ALPHABET, min_size=1, max_size=4).map("".join), min_size=1, max_size=3),
)
def test_stop_strings_cut_before_the_earliest_match(tiny, text: str, stops: list[str]) -> None:
    pieces, tail, detokenizer = stream(tiny, text, stop=stops)
    matches = [(text.find(s), s) for s in stops if s in text]
    expected = text[: min(matches)[0]] if matches else text
    assert "".join(pieces) + tail == expected
    assert detokenizer.text == expected
    if matches:
        assert detokenizer.stop_string is not None
        assert text.find(detokenizer.stop_string) == min(matches)[0]
        # A match is confirmed while streaming unless a stop that would start earlier could
        # still complete (stops "a" and "baa" on "ba"); then finish() confirms it.
        earlier_open = any(s.startswith(text[i:]) for s in stops for i in range(min(matches)[0]))
        assert tail == "" or earlier_open
    else:
        assert detokenizer.stop_string is None


def test_text_that_may_become_a_stop_string_is_held_then_flushed(tiny) -> None:
    pieces, tail, detokenizer = stream(tiny, "Hello wor", stop=["world"])
    assert "".join(pieces) == "Hello "
    assert tail == "wor"
    assert detokenizer.stop_string is None


def test_after_a_stop_string_feed_returns_nothing(tiny) -> None:
    detokenizer = IncrementalDetokenizer(tiny, [], ["world"])
    assert detokenizer.feed(tiny.encode("Hello world! The", False)) == "Hello "
    assert detokenizer.is_stopped
    assert detokenizer.feed(tiny.encode(" quick", False)) == ""
    assert detokenizer.finish() == ""


def test_a_truncated_character_is_dropped_at_finish(tiny) -> None:
    ids = tiny.encode("a龘b龘", False)
    cut = next(i for i in range(1, len(ids)) if tiny.decode(ids[:i]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tiny)
    assert detokenizer.feed(ids[:cut]) == "a"
    assert detokenizer.finish() == ""  # the cut-off bytes never show up as U+FFFD


def test_decoding_work_per_token_stays_bounded(tiny) -> None:
    calls: list[int] = []
    original = tiny.decode

    def counting_decode(ids, skip_special_tokens=True):
        calls.append(len(ids))
        return original(ids, skip_special_tokens)

    tiny.decode = counting_decode  # instance attribute: shadows the method for this object
    try:
        text = " ".join([FAKE_TEXTS[0]] * 30)
        pieces, tail, _ = stream(tiny, text)
    finally:
        del tiny.decode
    assert "".join(pieces) + tail == text
    assert len(tiny.encode(text, False)) > 400
    assert max(calls) <= 8  # a short window, not the whole output


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> Tokenizer:
    """SentencePiece-style: '▁' marks spaces and the decoder drops a leading one."""
    tokenizer = HFTokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(["Hello world, the quick brown fox."] * 10, trainer)
    directory = tmp_path_factory.mktemp("metaspace")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer(directory)


def test_leading_spaces_survive_with_prompt_context(metaspace) -> None:
    prompt = metaspace.encode("Hello", False)
    output = metaspace.encode("Hello world, the fox.", False)[len(prompt) :]
    detokenizer = IncrementalDetokenizer(metaspace, prompt)
    text = "".join(detokenizer.feed([t]) for t in output) + detokenizer.finish()
    assert text == " world, the fox."
    assert metaspace.decode(output) == "world, the fox."  # alone, the first space is lost


def test_directory_needs_tokenizer_json(tmp_path: Path) -> None:
    directory = build_tiny_tokenizer(tmp_path / "t")
    shutil.copytree(directory, tmp_path / "copy")
    (tmp_path / "copy" / "tokenizer.json").unlink()
    with pytest.raises(Exception, match=r"tokenizer\.json|No such file"):
        Tokenizer(tmp_path / "copy")
