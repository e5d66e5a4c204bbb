"""A tiny actor runtime on one asyncio loop: a mailbox, one task, a supervisor.

Each actor handles its messages one at a time in its own task, so its state needs
no locks. If an actor's task dies, its supervisor hears about it and decides what
that means (for the engine: every stream fails with EngineDeadError).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

M = TypeVar("M")
log = logging.getLogger(__name__)


class Mailbox(Generic[M]):
    """An asyncio queue; bounded where backpressure matters (maxsize > 0)."""

    def __init__(self, maxsize: int = 0) -> None:
        self._q: asyncio.Queue[M] = asyncio.Queue(maxsize)

    def send_nowait(self, msg: M) -> None:
        self._q.put_nowait(msg)

    async def send(self, msg: M) -> None:
        await self._q.put(msg)

    async def receive(self) -> M:
        return await self._q.get()

    def drain(self) -> list[M]:
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except asyncio.QueueEmpty:
                return out

    def empty(self) -> bool:
        return self._q.empty()

    def __len__(self) -> int:
        return self._q.qsize()


class Actor(Generic[M]):
    """Subclasses implement ``run`` (usually a receive loop); the owner starts and stops it."""

    name = "actor"

    def __init__(self, mailbox_size: int = 0) -> None:
        self.mailbox: Mailbox[M] = Mailbox(mailbox_size)
        self._task: asyncio.Task[None] | None = None
        self._on_crash: Callable[[Actor[M], BaseException], None] | None = None

    def start(self, on_crash: Callable[[Actor[M], BaseException], None]) -> None:
        self._on_crash = on_crash
        self._task = asyncio.get_running_loop().create_task(self._main(), name=self.name)

    async def _main(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # report, never swallow silently
            log.exception("actor %s crashed", self.name)
            if self._on_crash is not None:
                self._on_crash(self, e)

    async def run(self) -> None:
        raise NotImplementedError

    def send(self, msg: M) -> None:
        self.mailbox.send_nowait(msg)

    async def stop(self) -> None:
        """Cancel the task and wait for its end. The cancel is repeated each second until the
        task ends: code that swallows a cancellation (a library's, or asyncio's own wait_for
        before Python 3.12) must not leave the stop waiting for good."""
        task = self._task
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled():
            task.exception()  # seen: the supervisor heard of a crash already

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
