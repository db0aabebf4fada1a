"""Fixtures of the integration tests: a shared real server, the embedded model and its prompts.

Starting servers and scraping them: tests/integration/server.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.server import running_server


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """One shared server with the prefix cache on (the default config)."""
    with running_server() as url:
        yield url


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded SmolLM2 as a safetensors directory (converted once)."""
    from engine.core.config import EngineConfig
    from engine.runtime.loader import resolve_model_dir

    return str(resolve_model_dir(EngineConfig()))


@pytest.fixture(scope="session")
def prompts(model_dir) -> list[list[int]]:
    """benchmarks.questions.QUESTIONS as chat-templated prompt ids (HF's tokenizer)."""
    from transformers import AutoTokenizer

    from benchmarks.questions import QUESTIONS
    from tests.oracle import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [chat_prompt_ids(tokenizer, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def client(server_url):
    """The official openai client on the session's real `kvshare serve`."""
    import openai

    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
