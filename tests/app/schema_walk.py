"""Helpers of the structured-output property tests: walk a compiled grammar with a seeded
random choice among the tokens its mask allows (a stand-in for sampling: every token the
sampler could draw is one the mask allows), and check that objects keep schema key order."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import xgrammar as xgr

from engine.core.protocol import ModelInfo
from engine.runtime.grammar import tokenizer_info
from tests.json_tokenizer import EOS_TOKEN_ID, build_json_tokenizer, decode

VOCAB = 256
MAX_STEPS = 600


@cache
def tokenizer_dir() -> Path:
    import tempfile

    return build_json_tokenizer(Path(tempfile.mkdtemp(prefix="kvshare-json-tok-")))


@cache
def compiler() -> xgr.GrammarCompiler:
    info = ModelInfo("tiny", str(tokenizer_dir()), 256, VOCAB, (EOS_TOKEN_ID,), "v0")
    return xgr.GrammarCompiler(tokenizer_info(info), cache_enabled=False)


def walk(compiled: xgr.CompiledGrammar, seed: int) -> str:
    """The text of one seeded random walk through `compiled`, to its stop token."""
    rng = random.Random(seed)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    token_ids: list[int] = []
    for _ in range(MAX_STEPS):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = _allowed_ids(bitmask[0])
        if EOS_TOKEN_ID in allowed:
            break
        token_id = rng.choice(allowed)
        assert matcher.accept_token(token_id)
        token_ids.append(token_id)
    else:
        raise AssertionError(
            f"no stop after {MAX_STEPS} tokens: {decode(tokenizer_dir(), token_ids)}"
        )
    return decode(tokenizer_dir(), token_ids)


def _allowed_ids(row) -> list[int]:
    words = row.tolist()
    return [i for i in range(VOCAB) if (words[i // 32] >> (i % 32)) & 1]


def resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """schema with a local $ref followed (to the root's named definition or the root)."""
    while "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#").split("/")[1:]:
            node = node[part.replace("~1", "/").replace("~0", "~")]
        schema = node
    return schema


def check_key_order(instance: Any, schema: dict[str, Any], root: dict[str, Any]) -> None:
    """Every object in instance lists its keys in the order its schema's properties do."""
    schema = resolve(schema, root)
    for branch in schema.get("anyOf", []):  # the branch whose properties the keys belong to
        branch = resolve(branch, root)
        if isinstance(instance, dict) and set(instance) <= set(branch.get("properties", {})):
            schema = branch
            break
    if isinstance(instance, dict):
        order = list(schema.get("properties", {}))
        assert list(instance) == [key for key in order if key in instance], (instance, order)
        for key, value in instance.items():
            check_key_order(value, schema["properties"][key], root)
    elif isinstance(instance, list) and "items" in schema:
        for item in instance:
            check_key_order(item, schema["items"], root)


def pairs_in_order(text: str) -> Any:
    """json.loads that fails on a repeated key (a dict would hide one)."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        assert len(keys) == len(set(keys)), f"repeated key in {text}"
        return dict(pairs)

    return json.loads(text, object_pairs_hook=no_repeats)
