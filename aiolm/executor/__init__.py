"""Executors run SchedulerOutputs on workers: in process (local) or in worker processes."""

from aiolm.executor.base import Executor, ExecutorError

__all__ = ["Executor", "ExecutorError"]
