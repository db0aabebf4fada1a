"""SSE framing, keep-alives, and the plumbing that turns a client disconnect into an abort.

Every path ends in OpenAIServing._drive()'s finally-block, which aborts the request in the
engine (shielded, so it runs despite a cancel):
  - cancellation: Starlette cancels a streaming response when it sees http.disconnect, and
    cancel_on_disconnect() cancels a non-streaming request's work;
  - closing: SSEResponse closes its body generator when it ends, and each generator layer
    iterates the next under aclosing(), so one left suspended at a yield is closed now,
    not whenever garbage collection gets to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import SERVER_ERROR, APIError, error_body

logger = logging.getLogger(__name__)

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# One Server-Sent Event as the OpenAPI document declares text/event-stream (an item of the stream,
# as OpenAPI 3.2's itemSchema and schemathesis read it): its fields, `data` a JSON text or [DONE].
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"
_END = object()


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def sse_event(data: dict[str, Any], event: str | None = None) -> bytes:
    """One SSE event; `event` names it (an `event:` line, as the Responses API sends)."""
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


async def sse_events(
    events: AsyncIterator[bytes], keepalive_seconds: float, stop: asyncio.Event | None = None
) -> AsyncIterator[bytes]:
    """Events (from sse_event(), encoded where they are made: a large one in a worker
    thread), keep-alive comments while idle, then `data: [DONE]`.

    An error after the stream has begun (the 200 is already sent) goes out as one event in
    the OpenAI error shape, {"error": {...}}, followed by [DONE]; so does `stop` being set
    (the server's shutdown grace period is over), which ends the stream at once.
    """
    try:
        async with aclosing(with_keepalive(events, keepalive_seconds, stop)) as items:
            async for event in items:
                yield KEEPALIVE if event is None else event
    except APIError as e:
        yield sse_event(e.body())
    except Exception:
        logger.exception("stream failed")
        yield sse_event(error_body("Internal server error", SERVER_ERROR))
    yield DONE


async def named_sse_events(
    events: AsyncIterator[dict[str, Any]],
    keepalive_seconds: float,
    stop: asyncio.Event | None,
    idle: Callable[[], bytes],
    failed: Callable[[APIError], dict[str, Any] | None],
) -> AsyncIterator[bytes]:
    """Events as SSE events named by their `type` (the Responses and Messages APIs), `idle()`
    while none comes, no `[DONE]`. An error after the 200 (the engine failed the request, the
    drain's grace ended, anything else) becomes `failed(error)`'s event, if it makes one."""
    try:
        async with aclosing(with_keepalive(events, keepalive_seconds, stop)) as items:
            async for event in items:
                yield idle() if event is None else sse_event(event, event["type"])
        return
    except APIError as e:
        last = failed(e)
    except Exception:
        logger.exception("stream failed")
        last = failed(APIError(500, "Internal server error", type=SERVER_ERROR))
    if last is not None:
        yield sse_event(last, last["type"])


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator when it ends.

    Starlette leaves the iterator suspended when the client disconnects during a send;
    closing it here (not at garbage collection) is what aborts the request in the engine.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


def sse_response(
    events: AsyncIterator[bytes], keepalive_seconds: float, stop: asyncio.Event | None = None
) -> StreamingResponse:
    framed = sse_events(events, keepalive_seconds, stop)
    return SSEResponse(framed, media_type="text/event-stream", headers=SSE_HEADERS)


async def with_keepalive(
    source: AsyncIterator[T], interval: float, stop: asyncio.Event | None = None
) -> AsyncIterator[T | None]:
    """Items of `source`, and None whenever `interval` seconds pass without one. Once `stop`
    is set with no item ready, raises a 503 APIError (code "draining") instead of waiting on.

    The pending __anext__ runs as its own task so that waiting with a timeout never
    cancels the source; leaving early cancels that task and closes the source.
    """
    pending: asyncio.Future[T] | None = None
    stopped = None if stop is None else asyncio.ensure_future(stop.wait())
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            waiting = {pending} if stopped is None else {pending, stopped}
            done, _ = await asyncio.wait(
                waiting, timeout=interval, return_when=asyncio.FIRST_COMPLETED
            )
            if pending not in done:
                if stopped in done:
                    message = "The server shut down before this stream finished."
                    raise APIError(503, message, type=SERVER_ERROR, code="draining")
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            if stopped is not None:
                stopped.cancel()
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they come; the first error wins and stops all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((item, None))
        except Exception as e:
            queue.put_nowait((None, e))
        else:
            queue.put_nowait((_END, None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it as soon as the client disconnects.

    Raises ClientDisconnected in that case. Call it only after the request body has been
    read: from then on the ASGI server's receive() returns only http.disconnect.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        with anyio.CancelScope(shield=True):
            if not work_task.done():
                work_task.cancel()
            watch_task.cancel()
            await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


async def respond(
    request: Request,
    stream: bool,
    chunks: Callable[[], AsyncIterator[bytes]],
    complete: Callable[[], Awaitable[bytes]],
    keepalive_seconds: float,
    stop: asyncio.Event | None = None,
) -> Response:
    """Answer a generation request as SSE (stream: the `chunks()`, each an sse_event()) or
    as one JSON body (`complete()`: its bytes); only the one chosen is called. The callables
    are how the serving layer plugs in: this module imports nothing of app/serving/.

    Either way a client that disconnects cancels the work, which aborts it in the engine;
    a stream also ends when `stop` is set (see sse_events).
    """
    if stream:
        return sse_response(chunks(), keepalive_seconds, stop)
    try:
        body = await cancel_on_disconnect(request.receive, complete())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(body, media_type="application/json")
