"""What the engine core needs from an executor; awaitable, never blocking the loop."""

from __future__ import annotations

import abc
from typing import Any, Callable

from aiolm.core.outputs import ModelRunnerOutput, SchedulerOutput


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

    @abc.abstractmethod
    async def start(self) -> None:
        """Start workers and wait until each reports ready with its KV capacity."""

    @abc.abstractmethod
    async def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises ExecutorError if a worker died."""

    @abc.abstractmethod
    async def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call a method of every rank's model runner; one result per rank."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop workers and free every shared resource; safe to call twice."""

    def is_alive(self) -> bool:
        return True
