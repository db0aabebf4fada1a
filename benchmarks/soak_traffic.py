"""The soak's traffic (benchmarks/soak.py): random requests of every kind the server takes,
each sent to completion, cut by a disconnect at a random point, or expected to be refused.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable

import httpx

VOCAB_IDS = (200, 40_000)  # plain token ids for completions prompts (SmolLM2 has 49,152)
_WORD_TEXT = "river stone cloud maple orbit lantern copper meadow signal harbor velvet quartz"
_WORD_TEXT += " ember tundra falcon cedar prism glacier willow canyon ripple beacon saffron thistle"
WORDS = _WORD_TEXT.split()  # prompt words
SYSTEM_PROMPTS = [  # a few shared system prompts, so traffic hits and grows the prefix cache
    f"You are assistant number {i}. " + " ".join(WORDS[i:] + WORDS[:i]) * 3 for i in range(4)
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Traffic:
    """Random requests; each returns its outcome ("ok", "4xx expected", "disconnect ...")."""

    def __init__(self, http: httpx.AsyncClient, rng: random.Random, max_model_len: int) -> None:
        self.http, self.rng, self.max_model_len = http, rng, max_model_len
        self.kinds: list[tuple[Callable[[], Awaitable[str]], int]] = [
            (self.chat, 4),
            (self.chat_stream, 4),
            (self.completion, 2),
            (self.completion_stream, 2),
            (self.structured, 2),
            (self.near_limit, 2),
            (self.over_limit, 1),
            (self.disconnect_before_first_token, 1),
            (self.disconnect_mid_stream, 2),
            (self.disconnect_during_prefill, 1),
            (self.disconnect_non_streamed, 1),
        ]

    async def one(self) -> tuple[str, str]:
        """(kind of request, outcome) of one random request."""
        kinds, weights = zip(*self.kinds, strict=True)
        kind = self.rng.choices(kinds, weights)[0]
        try:
            return kind.__name__, await kind()
        except httpx.HTTPError as error:
            return kind.__name__, f"client error {type(error).__name__}"

    # Request bodies.
    def _sampling(self) -> dict:
        body: dict = {"max_tokens": self.rng.randint(4, 40)}
        if self.rng.random() < 0.5:
            body |= {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(2**31)}
        else:
            body |= {"temperature": 0}
        if self.rng.random() < 0.4:
            body["stop"] = self.rng.sample(["\n", ".", " the", "!", "?"], self.rng.randint(1, 3))
        if self.rng.random() < 0.3:
            body["n"] = self.rng.randint(2, 3)
        return body

    def _messages(self) -> list[dict]:
        question = " ".join(self.rng.choices(WORDS, k=self.rng.randint(3, 30)))
        return [
            {"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)},
            {"role": "user", "content": f"Tell me about {question}."},
        ]

    def _token_prompt(self, num_tokens: int) -> list[int]:
        return [self.rng.randint(*VOCAB_IDS) for _ in range(num_tokens)]

    # Kinds of request.
    async def chat(self) -> str:
        body = {"messages": self._messages(), **self._sampling()}
        return await self._complete("/chat/completions", body)

    async def completion(self) -> str:
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(5, 200)))
        return await self._complete("/completions", {"prompt": prompt, **self._sampling()})

    async def structured(self) -> str:
        body = {
            "messages": self._messages(),
            "max_tokens": 64,
            "temperature": 0.7,
            "seed": self.rng.randrange(2**31),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
            },
        }
        response = await self.http.post("/chat/completions", json=body)
        if response.status_code != 200:
            return status_outcome(response.status_code)
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            reply = json.loads(choice["message"]["content"])  # the grammar makes it parse
            if set(reply) != {"name", "age"}:
                return "wrong structured output"
        return "ok"

    async def near_limit(self) -> str:
        """A token prompt that, with its max_tokens, fills the context window exactly."""
        num_prompt = self.rng.randint(self.max_model_len - 48, self.max_model_len - 8)
        body = {"prompt": self._token_prompt(num_prompt), "temperature": 0}
        body["max_tokens"] = self.max_model_len - num_prompt
        return await self._complete("/completions", body)

    async def over_limit(self) -> str:
        body = {"prompt": self._token_prompt(self.max_model_len), "max_tokens": 4}
        response = await self.http.post("/completions", json=body)
        return (
            "4xx expected" if response.status_code == 400 else status_outcome(response.status_code)
        )

    async def chat_stream(self) -> str:
        body = {"messages": self._messages(), **self._sampling()}
        return await self._stream("/chat/completions", body, None)

    async def completion_stream(self) -> str:
        prompt = " ".join(self.rng.choices(WORDS, k=self.rng.randint(5, 200)))
        return await self._stream("/completions", {"prompt": prompt, **self._sampling()}, None)

    async def disconnect_mid_stream(self) -> str:
        body = {"messages": self._messages(), **self._sampling(), "max_tokens": 64}
        body["stop"] = None  # keep it streaming long enough to be cut
        return await self._stream("/chat/completions", body, self.rng.randint(1, 12))

    async def disconnect_before_first_token(self) -> str:
        body = {"messages": self._messages(), "max_tokens": 32, "stream": True}
        return await self._cancel_after(
            self.http.post("/chat/completions", json=body), 0.0, 0.03, "before first token"
        )

    async def disconnect_during_prefill(self) -> str:
        prompt = self._token_prompt(self.max_model_len - 40)
        body = {"prompt": prompt, "max_tokens": 16, "stream": self.rng.random() < 0.5}
        return await self._cancel_after(
            self.http.post("/completions", json=body), 0.1, 2.0, "during prefill"
        )

    async def disconnect_non_streamed(self) -> str:
        body = {"messages": self._messages(), "max_tokens": 64, "temperature": 0}
        return await self._cancel_after(
            self.http.post("/chat/completions", json=body), 0.1, 1.0, "non-streamed"
        )

    # How they are sent.
    async def _complete(self, path: str, body: dict) -> str:
        response = await self.http.post(path, json=body)
        if response.status_code != 200:
            return status_outcome(response.status_code)
        num_choices = len(response.json()["choices"])
        return "ok" if num_choices == body.get("n", 1) else "wrong number of choices"

    async def _stream(self, path: str, body: dict, cut_after: int | None) -> str:
        """Stream body; with cut_after, close the connection after that many events."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        num_events = 0
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return status_outcome(response.status_code)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "ok" if cut_after is None else "finished before the cut"
                if "error" in json.loads(line[len("data: ") :]):
                    return "5xx"  # the server failed the request mid-stream
                num_events += 1
                if cut_after is not None and num_events >= cut_after:
                    return "disconnect mid-stream"  # leaving the block closes the connection
        return "stream ended without [DONE]"

    async def _cancel_after(
        self, request: Awaitable, low_s: float, high_s: float, when: str
    ) -> str:
        task = asyncio.ensure_future(request)
        done, _ = await asyncio.wait({task}, timeout=self.rng.uniform(low_s, high_s))
        if done:
            response = task.result()
            return (
                "finished before the cut"
                if response.status_code == 200
                else status_outcome(response.status_code)
            )
        task.cancel()  # httpx drops the connection of a cancelled request
        await asyncio.gather(task, return_exceptions=True)
        return f"disconnect {when}"


def status_outcome(status: int) -> str:
    return "5xx" if status >= 500 else f"{status} unexpected"
