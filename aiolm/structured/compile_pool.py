"""The compile processes behind the engine's grammar check (``validator.py``), and the queue in
front of them.

Each process is ``python -m aiolm.structured.compile_worker`` (``compile_worker.py``), started
with asyncio's subprocess support (never fork or multiprocessing: DESIGN.md, "Workers are their
own programs"), and compiles one grammar at a time. Processes, not threads, because xgrammar
compiles in C++ that Python cannot interrupt: killing the process is the only way to end a
compile. The rules:

- A compile that runs past ``timeout`` (``--structured-outputs-compile-timeout``) is killed and
  its grammar refused with a message that says so (the validator remembers the refusal).
- When nobody waits for a compile any more (``release``: every request with that grammar has
  left) it is killed, unless it is younger than ``SLOW_AFTER_S``: a compile that young is
  probably small, and killing it would cost a process start (seconds of CPU), so it may finish
  (its verdict is cached) and is killed at that age if nobody has asked for it meanwhile.
- Small grammars do not queue behind big ones. At most ``processes - 1`` compiles may run
  longer than ``SLOW_AFTER_S`` at once (the slow lanes), so one process always takes new
  grammars. A compile that reaches that age while the slow lanes are taken is stopped and
  queued to start again, with its whole time limit, when a lane frees up. All ``processes``
  are started with the first grammar and kept, because a start (Python, torch and xgrammar
  imports) takes seconds: started only when a big compile needed one more, it would come too
  late for the grammar arriving beside it, and its burst of CPU would land in the middle of
  serving. They start one at a time, so that a CPU machine's workers never lose
  several cores to starts at once. The worst case, more big grammars at once than slow
  lanes, makes a new grammar wait up to ``SLOW_AFTER_S`` plus a start.
- A process that dies by itself is replaced; a grammar whose compile it was gets one more try,
  then is refused (``_MAX_CRASHES``). A process that cannot start fails the queue with its
  reason, and no new one is started until the next grammar arrives.

Processes start with the first grammar and stop with ``close`` (killed and reaped); each has a
lifeline (``compile_worker.py``), so none outlives an engine killed by SIGKILL. Nothing here
blocks the event loop: a request is written to its process's pipe without waiting (one at a
time per process), and one task per process reads its replies and reaps it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiolm.engine.errors import EngineDeadError
from aiolm.structured.compile_worker import HEADER_BYTES, encode_frame
from aiolm.structured.spec import StructuredOutputs
from aiolm.timeouts import wait_for

log = logging.getLogger(__name__)

PROCESSES = 3  # compile processes, each holding torch and xgrammar (docs/reliability.md)
SLOW_AFTER_S = 1.0  # a compile running this long counts as big
_MAX_CRASHES = 2  # a grammar whose compile process dies this often is refused
_START_TIMEOUT_S = 300.0  # imports, and the tokenizer when aiolm's cache has no tokenizer info for it
_EXIT_GRACE_S = 5.0  # a process whose output has ended gets this long to exit before SIGKILL
_STOPPED = "the engine stopped while the grammar was being checked"


@dataclass(eq=False)
class CompileJob:
    """One distinct grammar to check. ``waiters`` (the requests awaiting ``future``) is the
    validator's to count; the rest is the pool's."""

    spec: StructuredOutputs
    key: bytes
    text: bytes  # spec.text in UTF-8, as it is sent
    future: asyncio.Future[str | None]
    waiters: int = 0
    slow: bool = False  # ran past SLOW_AFTER_S once: needs a slow lane
    crashes: int = 0
    started: float = 0.0  # loop time its current compile began
    proc: _Proc | None = None  # the process compiling it, while one does


@dataclass(eq=False)
class _Proc:
    """One compile process: starting (``ready`` false), idle, or compiling ``job``."""

    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    job: CompileJob | None = None
    doomed: bool = False  # killed by the pool; its task only reaps it now
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class CompilePool:
    """The compile processes and the queue in front of them (see the module docstring).

    ``settled(job, error, remember)`` is called when a job's outcome is known, before its
    future is resolved (or cancelled, or failed): ``error`` is None or the message for the
    client; ``remember`` says whether it is a verdict about the grammar worth caching.
    """

    def __init__(
        self,
        tokenizer_dir: Path,
        vocab_size: int,
        timeout: float,
        processes: int,
        settled: Callable[[CompileJob, str | None, bool], None],
    ) -> None:
        if processes < 2:
            raise ValueError("a compile pool needs at least 2 processes: one stays free for small grammars")
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.timeout = timeout
        self.processes = processes
        self.slow_lanes = processes - 1
        self._settled = settled
        self.procs: list[_Proc] = []  # alive and not doomed: starting, idle or busy
        self._fresh: deque[CompileJob] = deque()  # jobs never started, or whose process died under them
        self._slow: deque[CompileJob] = deque()  # jobs stopped for want of a slow lane
        self._tasks: set[asyncio.Task[None]] = set()  # one per process, until it is reaped
        self._start_error: str | None = None  # set when a start failed: no new start until a submit
        self._closed = False

    # -- what the validator asks ----------------------------------------------------------

    def submit(self, job: CompileJob) -> None:
        if self._closed:
            self._fail(job, EngineDeadError(_STOPPED))
            return
        self._start_error = None  # try starting processes again
        self._fresh.append(job)
        self._dispatch()

    def release(self, job: CompileJob) -> None:
        """Nobody waits for ``job`` any more: drop it, or stop its compile (see the module docstring)."""
        p = job.proc
        if p is None:
            for queue in (self._fresh, self._slow):
                if job in queue:
                    queue.remove(job)
            self._cancel(job)
        elif job.slow or _now() - job.started >= SLOW_AFTER_S:
            self._kill(p, "every request waiting for its grammar has gone")
            self._cancel(job)
            self._dispatch()
        # else: a young compile may finish; _aged stops it if it is still unwatched then

    async def close(self) -> None:
        self._closed = True
        running = [p.job for p in self.procs if p.job is not None]
        for p in list(self.procs):
            self._kill(p, "the engine is stopping")
        for job in [*running, *self._fresh, *self._slow]:
            self._fail(job, EngineDeadError(_STOPPED))
        self._fresh.clear()
        self._slow.clear()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=10.0)

    # -- scheduling ------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start queued jobs on idle processes (slow ones only into a free slow lane), and keep
        ``processes`` started, starting one at a time."""
        if self._closed:
            return
        idle = [p for p in self.procs if p.ready and p.job is None]
        slow = sum(1 for p in self.procs if p.job is not None and p.job.slow)
        while idle and self._slow and slow < self.slow_lanes:
            if self._start(idle.pop(), self._slow[0]):
                self._slow.popleft()
                slow += 1
        while idle and self._fresh:
            if self._start(idle.pop(), self._fresh[0]):
                self._fresh.popleft()
        # One start at a time: a start is seconds of CPU (imports), taken from the workers on a
        # CPU machine, and the first grammar needs only the first process. After a failed start
        # the pool grows no more, but jobs left with no process at all (the last one died) get
        # one more start: it serves them, or fails them if it fails too.
        retry = not self.procs and bool(self._fresh or self._slow)
        if (
            (self._start_error is None or retry)
            and len(self.procs) < self.processes
            and all(p.ready for p in self.procs)
        ):
            self._spawn()

    def _start(self, p: _Proc, job: CompileJob) -> bool:
        """Send ``job`` to ``p``; False if ``p`` turned out to be gone (it is then replaced)."""
        assert p.process is not None and p.process.stdin is not None
        try:
            p.process.stdin.write(encode_frame({"kind": job.spec.kind, "strict": job.spec.strict}))
            p.process.stdin.write(len(job.text).to_bytes(HEADER_BYTES, "big"))
            p.process.stdin.write(job.text)
        except (RuntimeError, OSError):  # its pipe is closed: it died, and the end of its output is not read yet
            self._kill(p, "its input pipe is closed")
            return False
        loop = asyncio.get_running_loop()
        p.job, job.proc, job.started = job, p, loop.time()
        p.timers = [loop.call_later(self.timeout, self._timed_out, p, job)]
        if not job.slow and SLOW_AFTER_S < self.timeout:
            p.timers.append(loop.call_later(SLOW_AFTER_S, self._aged, p, job))
        return True

    def _timed_out(self, p: _Proc, job: CompileJob) -> None:
        if p.job is not job:
            return
        self._kill(p, f"its grammar ran past the {self.timeout:g} s limit")
        self._settle(
            job,
            f"the grammar took longer than {self.timeout:g} s to compile and was refused "
            f"(--structured-outputs-compile-timeout); a smaller schema or grammar compiles faster",
        )
        self._dispatch()

    def _aged(self, p: _Proc, job: CompileJob) -> None:
        """``job`` has compiled for SLOW_AFTER_S: it is big. It keeps its process if a slow lane
        is free (and someone still waits for it)."""
        if p.job is not job:
            return
        if job.waiters == 0:
            self._kill(p, "every request waiting for its grammar has gone")
            self._cancel(job)
        elif sum(1 for q in self.procs if q is not p and q.job is not None and q.job.slow) >= self.slow_lanes:
            self._kill(p, "a big grammar, and every slow lane is taken: it starts again when one is free")
            job.slow = True
            self._slow.append(job)
        else:
            job.slow = True
        self._dispatch()

    def _done(self, p: _Proc, error: str | None) -> None:
        job, p.job = p.job, None
        _cancel_timers(p)
        if job is not None:
            job.proc = None
            self._settle(job, error)
        self._dispatch()

    def _settle(self, job: CompileJob, error: str | None, remember: bool = True) -> None:
        if not job.future.done():
            self._settled(job, error, remember)
            job.future.set_result(error)

    def _cancel(self, job: CompileJob) -> None:
        if not job.future.done():
            self._settled(job, None, False)
            job.future.cancel()

    def _fail(self, job: CompileJob, error: BaseException) -> None:
        if not job.future.done():
            self._settled(job, None, False)
            job.future.set_exception(error)
            job.future.exception()  # retrieved: no warning if every waiter has gone

    # -- processes -------------------------------------------------------------------------

    def _spawn(self) -> None:
        p = _Proc()
        self.procs.append(p)
        task = asyncio.get_running_loop().create_task(self._run(p), name="aiolm-grammar-compile-process")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kill(self, p: _Proc, why: str) -> None:
        """Stop ``p`` now; its task reaps it. Its job, if any, is the caller's to settle."""
        if p.doomed:
            return
        p.doomed = True
        _cancel_timers(p)
        if p in self.procs:
            self.procs.remove(p)
        if p.job is not None:
            p.job.proc = None
            p.job = None
        if p.process is not None:
            _sigkill(p.process)
        if p.ready:
            log.info("grammar compile process %s stopped: %s", p.pid, why)

    async def _run(self, p: _Proc) -> None:
        """Start ``p``, wait for it to be ready, then read its replies until it ends; reap it."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        failure = ""
        try:
            p.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "aiolm.structured.compile_worker",
                "--parent-pid",
                str(os.getpid()),
                "--tokenizer-dir",
                str(self.tokenizer_dir),
                "--vocab-size",
                str(self.vocab_size),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            if p.doomed:  # the pool closed while it started
                _sigkill(p.process)
            assert p.process.stdout is not None
            try:
                hello = await wait_for(_read_frame(p.process.stdout), _START_TIMEOUT_S)
            except asyncio.TimeoutError:
                failure = f"the grammar compile process was not ready within {_START_TIMEOUT_S:g} s"
                return
            if not hello.get("ready"):
                failure = str(hello.get("error") or "the grammar compile process did not start")
                return
            p.ready = True
            log.info("grammar compile process %d ready in %.1f s", p.process.pid, loop.time() - t0)
            self._dispatch()
            while True:
                reply = await _read_frame(p.process.stdout)
                if not p.doomed:
                    self._done(p, reply.get("error"))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as e:
            failure = f"{type(e).__name__}: {e}" if not isinstance(e, asyncio.IncompleteReadError) else ""
        except asyncio.CancelledError:  # the loop is going away without close(): do not wait for it
            self._kill(p, "the event loop is stopping")
            raise
        finally:
            await self._reap(p, failure)

    async def _reap(self, p: _Proc, failure: str) -> None:
        """``p``'s output has ended: take it out of service now, wait for it to exit, then settle
        what it leaves behind (unless the pool killed it: then the killer did)."""
        if p in self.procs:
            self.procs.remove(p)
            _cancel_timers(p)
        code = None
        if p.process is not None:
            if not p.doomed:  # its output ended: it is exiting, or else it is stuck
                try:
                    await wait_for(asyncio.shield(p.process.wait()), _EXIT_GRACE_S)
                except asyncio.TimeoutError:
                    _sigkill(p.process)
            code = await p.process.wait()
        if p.doomed:
            return
        # It ended by itself: it could not start, or it died (the OOM killer, a crash in xgrammar).
        job, p.job = p.job, None
        if self._closed:
            if job is not None:
                self._fail(job, EngineDeadError(_STOPPED))
            return
        if not p.ready:
            self._start_error = failure or f"the grammar compile process exited with status {code} while starting"
            log.error("structured outputs: %s", self._start_error)
            if not self.procs:  # nobody left to take the queue
                for queued in [*self._fresh, *self._slow]:
                    self._settle(queued, f"structured outputs are unavailable: {self._start_error}", remember=False)
                self._fresh.clear()
                self._slow.clear()
        else:
            log.warning("grammar compile process %s died (exit status %s)", p.pid, code)
        if job is not None:
            job.proc = None
            job.crashes += 1
            if job.crashes >= _MAX_CRASHES:
                self._settle(
                    job,
                    f"the grammar compiler failed on this grammar (its process died {job.crashes} "
                    f"times, last with exit status {code})",
                )
            else:  # maybe not the grammar's fault: once more
                self._fresh.appendleft(job)
        self._dispatch()


async def _read_frame(stream: asyncio.StreamReader) -> dict[str, Any]:
    size = int.from_bytes(await stream.readexactly(HEADER_BYTES), "big")
    return json.loads(await stream.readexactly(size))


def _sigkill(process: asyncio.subprocess.Process) -> None:
    """SIGKILL ``process`` unless it is known to have ended. Not ``process.kill()``: under the
    standard event loop that polls (and may reap) the child first, and the loop's child watcher
    then finds it gone and reports exit status 255 with a warning."""
    if process.returncode is None:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cancel_timers(p: _Proc) -> None:
    for t in p.timers:
        t.cancel()
    p.timers = []


def _now() -> float:
    return asyncio.get_running_loop().time()
