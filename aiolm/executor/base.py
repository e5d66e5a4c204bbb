"""What the engine core needs from an executor; awaitable, never blocking the loop."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from typing import Any

from aiolm.core.step import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """A worker failed, hung or died; this executor cannot go on (a new one may).

    ``detail`` carries what the worker reported, usually its traceback.
    """

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class Executor(abc.ABC):
    num_blocks: int
    block_size: int
    block_bytes: int = 0  # one KV block's bytes on a rank, all layers (the largest rank's)

    @abc.abstractmethod
    async def start(self) -> None:
        """Start workers and wait until each reports ready with its KV capacity."""

    @abc.abstractmethod
    async def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises ExecutorError if a worker died."""

    async def submit(self, step: SchedulerOutput) -> Any:
        """Hand a step to the workers and return at once with a handle for ``result``.

        Steps run in the order submitted, so the engine may submit the next step before
        it has the previous one's result (overlap scheduling); results are read in the
        same order. This default runs ``execute`` as a task, which pipelines as long as
        ``execute`` queues its step before its first wait (the local executor's thread does).
        """
        return asyncio.ensure_future(self.execute(step))

    async def result(self, handle: Any) -> ModelRunnerOutput:
        """The result of a submitted step; raises ExecutorError if a worker died."""
        return await handle

    def abandon(self, handle: Any) -> None:
        """Give up a submitted step whose result will never be read (the executor failed)."""
        if isinstance(handle, asyncio.Future):
            handle.cancel()

    @abc.abstractmethod
    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call a method of every rank's model runner; one result per rank."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop workers and free every shared resource; safe to call twice."""

    def is_alive(self) -> bool:
        return True
