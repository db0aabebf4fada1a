"""Fixtures of the LLMEngine tests: the tiny random Llama of tests/engine/engine_helpers.py.

Module-scoped, as when each test module defined them: a module's engines and its HF twin see
one saved checkpoint. torch is imported inside the fixtures: the core/, kv/ and sched/ tests
under this folder run without it.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.engine.engine_helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from tests.engine.engine_helpers import load_hf_model

    return load_hf_model(tiny_model_dir)
