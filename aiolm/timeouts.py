"""``asyncio.wait_for`` that never loses a cancellation.

Before Python 3.12, ``asyncio.wait_for`` returns the awaited result when the caller is
cancelled in the same loop turn as that result arrives (CPython gh-86296): the caller's
task goes on as if never cancelled, and whoever cancelled it (an actor's ``stop``, a
shutdown) waits for an end that does not come. Every bounded wait in aiolm goes through
``wait_for`` here instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``aw``'s result within ``timeout`` seconds (None: no bound), else ``asyncio.TimeoutError``
    after cancelling it. A cancellation of the caller always propagates; ``aw`` is cancelled
    with it (a result that came in the same turn is dropped)."""
    if timeout is None:
        return await aw
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=max(timeout, 0.0))
    except asyncio.CancelledError:
        fut.cancel()
        fut.add_done_callback(_retrieve)
        raise
    if not done:
        fut.cancel()
        try:
            await asyncio.wait({fut})  # its cleanup runs before the timeout is reported, as with asyncio's
        except asyncio.CancelledError:
            fut.add_done_callback(_retrieve)
            raise
        if fut.cancelled():
            raise asyncio.TimeoutError
    return fut.result()


def _retrieve(fut: asyncio.Future[object]) -> None:
    """Mark a dropped future's exception as seen (asyncio logs one nobody retrieved)."""
    if not fut.cancelled():
        fut.exception()
