"""The engine's grammar check: each distinct grammar is compiled once, in a compile process that
can be killed, before its first request is queued.

Why processes: xgrammar compiles in C++ that Python cannot interrupt. In a thread pool a huge
JSON schema held its thread for minutes, went on compiling after its client had left, and two
such schemas filled the pool so that an unrelated ``choice`` waited behind them. A process can
be killed, so here every compile runs in a ``python -m aiolm.structured.compile_worker``
process (``compile_worker.py``; started with asyncio's subprocess support, never fork or
multiprocessing: DESIGN.md, "Workers are their own programs"), one grammar at a time:

- A compile that runs past ``timeout`` (``--structured-outputs-compile-timeout``) is killed
  and its grammar refused with a 400 that says so. The refusal is remembered like any other
  verdict, so the same grammar is not compiled again.
- Requests with the same grammar share one compile. When the last of them leaves (a client
  disconnects, a task is cancelled) the compile is killed, unless it is younger than
  ``SLOW_AFTER_S``: a compile that young is probably small, killing it would cost a process
  start (seconds of CPU), so it may finish (its verdict is cached) and is killed at that age
  if nobody has asked for it meanwhile.
- Small grammars do not queue behind big ones. At most ``max_processes - 1`` compiles may run
  longer than ``SLOW_AFTER_S`` at once (the slow lanes), so one process always takes new
  grammars. A compile that reaches that age while the slow lanes are taken is stopped and
  queued to start again, with its whole time limit, when a slow lane frees up. Besides the
  busy processes the pool keeps ``SPARES`` idle ones started (up to ``max_processes``),
  because a start (Python, torch and xgrammar imports) takes seconds. The worst case, more
  big grammars at once than slow lanes, makes a new grammar wait up to ``SLOW_AFTER_S`` plus
  a process start.

Processes start on the first grammar that is not in the cache, and stop with the engine
(``close``); each has a lifeline (``compile_worker.py``), so none outlives an engine killed by
SIGKILL. Cache hits never touch the pool. Nothing here blocks the event loop: requests are
written to a process's pipe without waiting (one at a time per process), replies are read by
one task per process, grammar texts are hashed in a thread past ``_HASH_ON_LOOP_BYTES``, and
the cache is bounded (``_CACHE_ENTRIES`` verdicts, keyed by a digest, not by the text). The
engine process never imports xgrammar, nor the torch it imports.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiolm.engine.errors import EngineDeadError
from aiolm.params import ParamError
from aiolm.structured.backend import BACKENDS
from aiolm.structured.compile_worker import HEADER_BYTES, encode_frame
from aiolm.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)

_CACHE_ENTRIES = 256  # distinct grammars whose verdict is remembered
_HASH_ON_LOOP_BYTES = 64 << 10  # longer grammar texts are hashed in a thread
MAX_PROCESSES = 3  # compile processes at most (each holds torch and xgrammar: docs/reliability.md)
SPARES = 2  # idle processes kept started besides the busy ones, within MAX_PROCESSES
SLOW_AFTER_S = 1.0  # a compile running this long counts as big
_MAX_CRASHES = 2  # a grammar whose compile process dies this often is refused
_START_TIMEOUT_S = 300.0  # imports, and the tokenizer when aiolm's cache has no tokenizer info for it
_EXIT_GRACE_S = 5.0  # a process whose output has ended gets this long to exit before SIGKILL
_STOPPED = "the engine stopped while the grammar was being checked"


@dataclass(eq=False)
class _Job:
    """One distinct grammar being checked, and the requests waiting for it."""

    spec: StructuredOutputs
    key: bytes
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
    job: _Job | None = None
    doomed: bool = False  # killed by the pool; its task only reaps it now
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Validator:
    """Engine side: refuses a request whose grammar does not compile, or does not within
    ``compile_timeout`` seconds, with ParamError('structured_outputs', message).

    A request awaits its own check only; the event loop and other requests run on. Verdicts
    (None, or the compiler's message) are cached by the grammar's digest.
    """

    def __init__(self, backend: str = "xgrammar", compile_timeout: float = 30.0,
                 max_processes: int = MAX_PROCESSES) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend: {backend!r}; supported: {', '.join(BACKENDS)}")
        if not compile_timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 seconds, got {compile_timeout!r}")
        self.backend = backend
        self.compile_timeout = compile_timeout
        self.max_processes = max_processes
        self.tokenizer_dir: Path | None = None  # set by configure() once the engine knows its model
        self.vocab_size = 0
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self._jobs: dict[bytes, _Job] = {}
        self.pool: CompilePool | None = None  # started with the first grammar not in the cache

    def configure(self, tokenizer_dir: Path, vocab_size: int) -> None:
        """Compile against the tokenizer in this folder (the engine's, the one the workers load)."""
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size

    async def check(self, spec: StructuredOutputs | None) -> None:
        """Raise ParamError('structured_outputs', message) if the grammar is refused."""
        if spec is None:
            return
        if self.backend == "none":
            raise ParamError("structured_outputs", "structured outputs are disabled on this server "
                                                   "(--structured-outputs-backend none)")
        key = await _digest(spec)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            error = self._verdicts[key]
        else:
            error = await self._compile(spec, key)
        if error is not None:
            raise ParamError("structured_outputs", error)

    async def _compile(self, spec: StructuredOutputs, key: bytes) -> str | None:
        job = self._jobs.get(key)
        if job is None:  # concurrent requests with the same grammar share one compile
            if self.pool is None:
                if self.tokenizer_dir is None:
                    raise RuntimeError("Validator.configure() was not called")
                self.pool = CompilePool(self.tokenizer_dir, self.vocab_size, self.compile_timeout,
                                        self.max_processes, self._settled)
            job = self._jobs[key] = _Job(spec, key, asyncio.get_running_loop().create_future())
            self.pool.submit(job)
        job.waiters += 1
        try:
            return await asyncio.shield(job.future)
        finally:
            job.waiters -= 1
            if job.waiters == 0 and not job.future.done() and self.pool is not None:
                self.pool.release(job)

    def _settled(self, job: _Job, error: str | None, remember: bool) -> None:
        """The pool's word on ``job``, before its future is resolved or cancelled."""
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if remember:
            self._verdicts[job.key] = error
            while len(self._verdicts) > _CACHE_ENTRIES:
                self._verdicts.popitem(last=False)

    async def close(self) -> None:
        """Stop every compile process and reap it; pending checks fail with EngineDeadError."""
        if self.pool is not None:
            await self.pool.close()


async def _digest(spec: StructuredOutputs) -> bytes:
    head = f"{spec.kind}\0{spec.strict}\0".encode()
    if len(spec.text) <= _HASH_ON_LOOP_BYTES:
        return hashlib.sha256(head + spec.text.encode()).digest()
    return await asyncio.to_thread(lambda: hashlib.sha256(head + spec.text.encode()).digest())


class CompilePool:
    """The compile processes and the queue in front of them (see the module docstring)."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, timeout: float, max_processes: int,
                 settled: Callable[[_Job, str | None, bool], None]) -> None:
        if max_processes < 2:
            raise ValueError("a compile pool needs at least 2 processes: one stays free for small grammars")
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.timeout = timeout
        self.max_processes = max_processes
        self.slow_lanes = max_processes - 1
        self._settled = settled
        self.procs: list[_Proc] = []  # alive and not doomed: starting, idle or busy
        self._fresh: deque[_Job] = deque()  # jobs never started, or whose process died under them
        self._slow: deque[_Job] = deque()  # jobs stopped for want of a slow lane
        self._tasks: set[asyncio.Task[None]] = set()  # one per process, until it is reaped
        self._start_error: str | None = None  # set when a start failed: no new start until a submit
        self._closed = False

    # -- what the validator asks ----------------------------------------------------------

    def submit(self, job: _Job) -> None:
        if self._closed:
            self._fail(job, EngineDeadError(_STOPPED))
            return
        self._start_error = None  # try starting processes again
        self._fresh.append(job)
        self._dispatch()

    def release(self, job: _Job) -> None:
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
        ``SPARES`` idle processes started besides the busy ones."""
        if self._closed:
            return
        idle = [p for p in self.procs if p.ready and p.job is None]
        slow = sum(1 for p in self.procs if p.job is not None and p.job.slow)
        while idle and self._slow and slow < self.slow_lanes:
            self._start(idle.pop(), self._slow.popleft())
            slow += 1
        while idle and self._fresh:
            self._start(idle.pop(), self._fresh.popleft())
        if self._start_error is None:
            busy = sum(1 for p in self.procs if p.job is not None)
            for _ in range(min(self.max_processes, busy + SPARES) - len(self.procs)):
                self._spawn()

    def _start(self, p: _Proc, job: _Job) -> None:
        assert p.process is not None and p.process.stdin is not None
        loop = asyncio.get_running_loop()
        p.job, job.proc, job.started = job, p, loop.time()
        p.process.stdin.write(encode_frame({"kind": job.spec.kind, "text": job.spec.text,
                                            "strict": job.spec.strict}))
        p.timers = [loop.call_later(self.timeout, self._timed_out, p, job)]
        if not job.slow and SLOW_AFTER_S < self.timeout:
            p.timers.append(loop.call_later(SLOW_AFTER_S, self._aged, p, job))

    def _timed_out(self, p: _Proc, job: _Job) -> None:
        if p.job is not job:
            return
        self._kill(p, f"its grammar ran past the {self.timeout:g} s limit")
        self._settle(job, f"the grammar took longer than {self.timeout:g} s to compile and was refused "
                          f"(--structured-outputs-compile-timeout); a smaller schema or grammar compiles faster")
        self._dispatch()

    def _aged(self, p: _Proc, job: _Job) -> None:
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

    def _settle(self, job: _Job, error: str | None, remember: bool = True) -> None:
        if not job.future.done():
            self._settled(job, error, remember)
            job.future.set_result(error)

    def _cancel(self, job: _Job) -> None:
        if not job.future.done():
            self._settled(job, None, False)
            job.future.cancel()

    def _fail(self, job: _Job, error: BaseException) -> None:
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
                sys.executable, "-m", "aiolm.structured.compile_worker", "--parent-pid", str(os.getpid()),
                "--tokenizer-dir", str(self.tokenizer_dir), "--vocab-size", str(self.vocab_size),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            if p.doomed:  # the pool closed while it started
                _sigkill(p.process)
            assert p.process.stdout is not None
            try:
                hello = await asyncio.wait_for(_read_frame(p.process.stdout), _START_TIMEOUT_S)
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
        code = None
        if p.process is not None:
            if not p.doomed:  # its output ended: it is exiting, or else it is stuck
                try:
                    await asyncio.wait_for(asyncio.shield(p.process.wait()), _EXIT_GRACE_S)
                except asyncio.TimeoutError:
                    _sigkill(p.process)
            code = await p.process.wait()
        if p.doomed or self._closed:
            return
        # It ended by itself: it could not start, or it died (the OOM killer, a crash in xgrammar).
        self.procs.remove(p)
        job, p.job = p.job, None
        _cancel_timers(p)
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
                self._settle(job, f"the grammar compiler failed on this grammar (its process died {job.crashes} "
                                  f"times, last with exit status {code})")
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
