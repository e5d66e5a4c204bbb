"""Helpers shared by the end-to-end engine tests: an engine loop in a thread, light args."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# Light engine: small context and KV cache; one torch thread per worker, because
# extra intra-op threads only fight each other on a small, shared CPU machine.
ENGINE_ARGS: dict[str, Any] = dict(
    max_model_len=1024,
    kv_cache_memory=256 << 20,
    max_num_seqs=32,
    max_num_batched_tokens=1024,
    num_threads=1,
    executor="mp",
)

# The Ray tests' workload (test_ray_executor.py, test_ray_cluster.py; conftest.py's
# ray_reference computes its tokens once for both).
RAY_ARGS: dict[str, Any] = dict(
    max_model_len=256, kv_cache_memory=32 << 20, max_num_seqs=8, max_num_batched_tokens=256, num_threads=1
)
RAY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
RAY_MAX_NEW = 24


def our_segments() -> set[str]:
    """This process's shared-memory segments (an engine's rings, all-reduce, heartbeats)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{os.getpid()}_")}


async def greedy_streams(
    engine: Any, prompts: list, max_new: int, started: asyncio.Event | None = None, after: int = 1
) -> list[list[int]]:
    """Each prompt's greedy tokens (``ignore_eos``), all streamed at once; ``started`` is set
    once every stream has ``after`` tokens (a fault injected then hits every stream mid-way)."""
    from aiolm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    counts = [0] * len(prompts)

    async def one(i: int, prompt: Any) -> list[int]:
        final = None
        async for out in engine.generate(prompt, params):
            final = out
            counts[i] = len(out.outputs[0].token_ids)
            if started is not None and min(counts) >= after:
                started.set()
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def overlap_s(a: list[tuple[int, float, float]], b: list[tuple[int, float, float]]) -> float:
    """Seconds two pipeline stages' traces (ModelRunner.stage_trace) computed at the same time."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for _, a0, a1 in a for _, b0, b1 in b)


class LoopThread:
    """An event loop (uvloop when installed) running forever in a daemon thread."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run a coroutine on the loop and wait for its result (cancelled on timeout, after
        the loop's tasks and the process's threads are printed to stderr: where it waited)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            print(f"\n{timeout:g} s passed: the loop's tasks and the threads, as they stand", file=sys.stderr)
            try:  # read from this thread while the loop runs: a diagnosis, so best effort
                for task in list(asyncio.all_tasks(self.loop)):
                    task.print_stack(file=sys.stderr)
            except RuntimeError:
                pass
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            fut.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@contextlib.contextmanager
def running(engine: Any, start_timeout: float = 600.0, stop_timeout: float = 120.0):
    """``engine`` started on its own LoopThread: yields (the loop thread, the engine), and
    shuts both down afterwards, whatever happened."""
    lt = LoopThread()
    try:
        lt.run(engine.start(), timeout=start_timeout)
        yield lt, engine
    finally:
        lt.run(engine.shutdown(), timeout=stop_timeout)
        lt.close()


async def after_death(engine: Any, executor: Any, timeout: float = 5.0) -> tuple[bool, bool, bool, tuple[int, int]]:
    """(core running, output running, executor closed, (running, waiting)) once a dead engine has
    stopped its actors and executor by itself (or after ``timeout``)."""
    for _ in range(int(timeout / 0.05)):
        if not engine.core.running and not engine.output.running and executor._closed:
            break
        await asyncio.sleep(0.05)
    return engine.core.running, engine.output.running, executor._closed, engine.num_requests()


def thread_schedstat() -> tuple[float, float] | None:
    """(seconds on CPU, seconds waiting on a run queue) of the calling thread, if the kernel says."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def one_torch_thread():
    """References computed in the test process: one thread is much faster on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
