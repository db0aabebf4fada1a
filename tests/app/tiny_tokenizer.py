"""A small byte-level BPE tokenizer directory for fast tests (built in seconds, no downloads).

Characters that appear once in the corpus stay split into byte tokens, so CJK and emoji
in FAKE_TEXTS are spread over several tokens: the detokenizer must hold them back.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# What the fake engine "generates"; rare characters (once in the corpus) stay byte-split.
FAKE_TEXTS = (
    "Hello world! 你好 🙂 The quick brown fox jumps over the lazy dog.",
    "Rare 龘 and 𝄞 and ☃ end here.",
    "Sure: the answer is 42, as the hitchhiker said.",
)

_CORPUS = [
    *["Hello world! The quick brown fox jumps over the lazy dog."] * 20,
    *["Sure: the answer is 42, as the hitchhiker said. end here and"] * 10,
    *["你好世界，今天天气很好。"] * 5,
    *["system user assistant You are a helpful assistant. What is the answer?"] * 10,
    "Rare",
]


def build_tiny_tokenizer(directory: Path, chat_template: str = CHATML_TEMPLATE) -> Path:
    """Train and save tokenizer.json + tokenizer_config.json into `directory`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": 256,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory
