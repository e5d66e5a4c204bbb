"""Worker recovery: replace a failed worker set, within a restart budget.

A worker that dies, hangs past the step timeout or raises in a step leaves its
executor unusable (its persistent batch and KV cache are gone or suspect). The
engine core then asks this supervisor for a new executor: the old one is shut
down (processes reaped, rings unlinked), a new worker set starts and loads the
weights again from the local file, and the core puts every in-flight request
back in the queue to be recomputed (Scheduler.reset_workers). A greedy stream
therefore continues with the same text a fault-free run gives.

A request whose steps were in two worker failures is failed instead of requeued a third
time (EngineCore._fail_suspects): whatever in it breaks the workers would otherwise spend
the whole budget below.

Restarts are bounded: more than ``max_restarts`` within ``window`` seconds means
the fault is not transient, and the supervisor gives up with EngineDeadError
(the engine then stops cleanly and a process supervisor may restart the server).
With recovery off it gives up at the first failure.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable

from aiolm.engine.errors import EngineDeadError
from aiolm.executor.base import Executor, ExecutorError

log = logging.getLogger(__name__)


class WorkerSupervisor:
    """Decides whether a failed executor may be replaced, and replaces it."""

    def __init__(
        self,
        make_executor: Callable[[int], Awaitable[Executor]],
        enabled: bool = True,
        max_restarts: int = 3,
        window: float = 600.0,
    ) -> None:
        self.make_executor = make_executor  # incarnation -> a started executor
        self.enabled = enabled
        self.max_restarts = max_restarts
        self.window = window
        self.restarts = 0  # over the engine's life, for metrics and logs
        self._recent: collections.deque[float] = collections.deque()
        self.recovering: str | None = None  # why, while a replacement is under way

    def _allowed(self, now: float) -> bool:
        while self._recent and now - self._recent[0] > self.window:
            self._recent.popleft()
        return self.enabled and len(self._recent) < self.max_restarts

    async def replace(self, old: Executor, error: BaseException) -> Executor:
        """A started executor in place of ``old``, or EngineDeadError when not allowed."""
        reason = str(error)
        detail = getattr(error, "detail", None)
        log.error("worker failure: %s%s", reason, f"\n{detail}" if detail else "")
        now = time.monotonic()
        if not self._allowed(now):
            why = (
                "worker recovery is off"
                if not self.enabled
                else f"{self.max_restarts} restarts within {self.window:g} s already"
            )
            await old.shutdown()
            raise EngineDeadError(f"{reason} ({why})")
        self._recent.append(now)
        self.restarts += 1
        self.recovering = reason
        try:
            await old.shutdown()
            log.warning("restarting the workers (restart %d): %s", self.restarts, reason)
            t0 = time.monotonic()
            try:
                new = await self.make_executor(self.restarts)
            except (ExecutorError, OSError, RuntimeError) as e:
                raise EngineDeadError(f"{reason}; restarting the workers failed: {e}") from e
            log.warning("workers restarted in %.1f s; %d KV blocks", time.monotonic() - t0, new.num_blocks)
            return new
        finally:
            self.recovering = None
