"""Bounded waits: ``asyncio.wait_for`` that never loses a cancellation, and blocking calls
that a timeout can leave behind.

Before Python 3.12, ``asyncio.wait_for`` returns the awaited result when the caller is
cancelled in the same loop turn as that result arrives (CPython gh-86296): the caller's
task goes on as if never cancelled, and whoever cancelled it (an actor's ``stop``, a
shutdown) waits for an end that does not come. Every bounded wait in aiolm goes through
``wait_for`` here instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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


def in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` run in a daemon thread of its own, as a future of the running loop. Unlike
    ``asyncio.to_thread``, a call given up on (past ``wait_for``'s timeout: a control plane that
    does not answer) does not hold up the process's exit, which joins the loop's executor."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return  # given up on
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=run, name=f"aiolm-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return fut
