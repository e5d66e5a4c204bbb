"""In-process executor: the model runner in this process, run in a worker thread.

For tests and debugging; production uses worker processes. The forward pass runs
in a thread so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import functools
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiolm.core.step import ModelRunnerOutput, SchedulerOutput
from aiolm.executor.base import Executor, ExecutorError
from aiolm.worker.model_runner import ModelRunner, RunnerConfig, call_on_runner


class LocalExecutor(Executor):
    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.runner: ModelRunner | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiolm-local")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self._pool, ModelRunner, self.cfg)
        self.num_blocks = self.runner.num_blocks
        self.block_bytes = self.runner.kv_cache_info()["block_bytes"]

    async def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "executor not started"
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.runner.execute, step)
        except Exception as e:  # the runner's batch state is suspect now: the engine replaces it
            raise ExecutorError(f"the step failed: {type(e).__name__}: {e}", traceback.format_exc()) from e

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        assert self.runner is not None
        call = functools.partial(call_on_runner, self.runner, method, args, kwargs)
        return [await asyncio.get_running_loop().run_in_executor(self._pool, call)]

    async def shutdown(self) -> None:
        if self.runner is not None:
            try:
                done = asyncio.get_running_loop().run_in_executor(self._pool, self.runner.close)
            except RuntimeError:  # at interpreter exit the thread pools take no more work:
                self.runner.close()  # the step thread is idle by now, so close it here
            else:
                await done
        self._pool.shutdown(wait=False)
        self.runner = None
