"""Server-sent events and client-disconnect detection on the raw ASGI channel.

A generation must stop the moment its client leaves, whether it streams or not.
Waiting for the next failed ``send`` is not enough (a long prefill sends
nothing for seconds), so every generation runs next to a task that reads the
ASGI ``receive`` channel until ``http.disconnect`` and cancels it then;
cancelling unwinds into the engine's abort, which frees the KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from aiolm.server.errors import dumps

log = logging.getLogger("aiolm.server")
T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has gone (call only after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(task: asyncio.Task[Any]) -> None:
    if task.done():
        return
    task.cancel()
    # Its end, without its error (the cancelled work's own is not ours to raise); a cancel of
    # our own while we wait still goes up (awaiting the task itself could not tell them apart).
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (e.g. the server's shutdown timeout)
        watcher.cancel()  # both at once: a second cancel while waiting must not spare the work
        task.cancel()
        await _cancel(watcher)
        await _cancel(task)
        raise
    await _cancel(watcher)
    if not task.done():
        await _cancel(task)
        raise ClientGone()
    return task.result()


@dataclass(frozen=True)
class NamedEvent:
    """An event with an ``event:`` line: the Responses API names every event by its type."""

    name: str
    data: Any


def sse_event(data: Any) -> bytes:
    if isinstance(data, NamedEvent):
        return f"event: {data.name}\n".encode() + sse_event(data.data)
    payload = data if isinstance(data, str) else dumps(data)
    return f"data: {payload}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class EventStream:
    """An ASGI response streaming ``data: {...}`` events, then ``data: [DONE]`` (unless
    ``done`` is false: the Responses API ends with its own event instead).

    ``events`` yields JSON-able objects or NamedEvents. If the client disconnects, the
    iterator is cancelled and closed at once (its ``finally`` aborts the engine
    request; ``close`` does it too, for a client gone before the first event);
    ``on_gone`` is called so the access log can say so.
    """

    def __init__(
        self,
        events: AsyncIterator[Any],
        headers: dict[str, str] | None = None,
        on_gone: Callable[[], None] | None = None,
        done: bool = True,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.headers = headers or {}
        self.on_gone = on_gone
        self.done = done
        self.close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        try:
            await until_disconnect(receive, self._pump(send, headers))
        except ClientGone:
            if self.on_gone is not None:
                self.on_gone()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.close is not None:  # a generator never started skips its own finally on aclose
                await self.close()

    async def _pump(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            async for item in self.events:
                await send({"type": "http.response.body", "body": sse_event(item), "more_body": True})
            await send({"type": "http.response.body", "body": DONE if self.done else b"", "more_body": False})
        except OSError:  # the server reports a vanished client on send (ASGI 2.4)
            if self.on_gone is not None:
                self.on_gone()
