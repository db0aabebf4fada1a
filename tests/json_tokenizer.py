"""A tiny byte-level tokenizer that can spell any printable-ASCII JSON (built in code, no
downloads), for grammar tests over the tiny random models (vocab 256).

Ids 0-2 are <pad>, <s>, </s> (the tiny models' bos is 1 and eos is 2), then every printable
ASCII byte, then a few multi-character JSON pieces (so tokens can span grammar boundaries).
It has fewer tokens than the model's 256: the ids above it are padding a grammar must mask.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
EOS_TOKEN_ID = 2
PIECES = ('{"', '":', '",', '"}', '","', "true", "false", "null", "ab", "name", "10", "[]", "{}")


def _byte_level(text: str) -> str:
    """text (ASCII) as byte-level BPE writes it (a space is 'Ġ')."""
    alphabet = {chr(b): c for b, c in zip(range(256), _byte_alphabet(), strict=True)}
    return "".join(alphabet[ch] for ch in text)


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the character byte b is written as, for b in 0..255."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def json_vocab() -> dict[str, int]:
    """token (byte-level form) -> id."""
    tokens = [*SPECIAL_TOKENS, *(_byte_level(chr(b)) for b in range(32, 127))]
    tokens += [_byte_level(piece) for piece in PIECES]
    return {token: i for i, token in enumerate(tokens)}


def build_json_tokenizer(directory: Path) -> Path:
    """Save tokenizer.json + tokenizer_config.json into `directory` (next to a tiny model)."""
    tokenizer = Tokenizer(models.BPE(vocab=json_vocab(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 256,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def decode(directory: Path, token_ids: list[int]) -> str:
    """The text of token_ids, special tokens left out."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tokenizer.decode(token_ids, skip_special_tokens=True)
