"""A data-parallel replica process, as the front end sees it (data_parallel.py).

``ReplicaClient`` launches the process (``ProcessLauncher`` here, or a Ray actor on a
cluster node: replica_ray.py), waits for its engine to start, and then sends it
requests and reads back their outputs (replica_link.py). Everything the front end
routes and reports by is local and cheap to read: the live sequences it sent there,
and the health and counters the replica pushes every ``STATUS_PERIOD_S``.

When the connection ends without a shutdown (the process was killed, its engine
died, its node went away) every request still on it fails with EngineDeadError, and
so do calls waiting for a reply; ``on_death`` then runs once with the reason.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from aiolm.config import EngineArgs
from aiolm.engine.errors import EngineDeadError
from aiolm.engine.replica_link import SECRET_BYTES, SECRET_ENV, STATUS_PERIOD_S, read_message, write_message
from aiolm.executor.multiproc import reap
from aiolm.metrics import as_dead
from aiolm.outputs import RequestOutput
from aiolm.timeouts import wait_for

log = logging.getLogger(__name__)

# A replica that has sent nothing for this long (it pushes its status every STATUS_PERIOD_S)
# is taken for lost: its node is gone or its loop is wedged, and TCP alone may not say so.
SILENT_LIMIT_S = 60 * STATUS_PERIOD_S


class Launcher(Protocol):
    """Starts one replica process somewhere and can tell whether it still runs."""

    def launch(self, connect: str, secret: bytes, index: int, log_level: str) -> None: ...

    def exited(self) -> str | None:
        """How the process ended, or None while it runs."""
        ...

    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for it to end, then kill it."""
        ...

    def where(self) -> str: ...


class ProcessLauncher:
    """A replica as a child process of the front end, on this machine."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self, connect: str, secret: bytes, index: int, log_level: str) -> None:
        self.proc = subprocess.Popen(
            replica_command(connect, index, os.getpid(), log_level),
            env={**os.environ, SECRET_ENV: secret.hex()},
            stdin=subprocess.DEVNULL,
        )

    def exited(self) -> str | None:
        rc = self.proc.poll() if self.proc is not None else None
        return None if rc is None else exit_text(rc)

    async def stop(self, grace: float) -> None:
        if self.proc is not None:
            await reap(self.proc, grace)

    def where(self) -> str:
        return f"pid {self.proc.pid}" if self.proc is not None else "not launched"


def replica_command(connect: str, index: int, parent_pid: int, log_level: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "aiolm.engine.replica",
        "--connect",
        connect,
        "--index",
        str(index),
        "--parent-pid",
        str(parent_pid),
        "--log-level",
        log_level,
    ]


def exit_text(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


class ReplicaListener:
    """The front end's one listening socket: each replica connects back and proves who it
    is with its secret before a byte of it is unpickled."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self._waiting: dict[bytes, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def expect(self, secret: bytes) -> asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        fut: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[secret] = fut
        return fut

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            got = await wait_for(reader.readexactly(SECRET_BYTES), 10.0)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        for secret, fut in list(self._waiting.items()):
            if hmac.compare_digest(got, secret):
                del self._waiting[secret]
                if not fut.done():
                    fut.set_result((reader, writer))
                    return
        log.warning("a connection to the replica port without a replica's secret was refused")
        writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


class RemoteRequest:
    """One request on a replica: its outputs as they arrive, in order."""

    def __init__(self, req_id: str, n: int) -> None:
        self.req_id = req_id
        self.n = n  # sequences: its share of the replica's load
        self._items: collections.deque[tuple[RequestOutput | None, BaseException | None]] = collections.deque()
        self._event = asyncio.Event()

    def push(self, out: RequestOutput | None, error: BaseException | None) -> None:
        self._items.append((out, error))
        self._event.set()

    async def next(self) -> tuple[RequestOutput | None, BaseException | None]:
        while not self._items:
            self._event.clear()
            await self._event.wait()
        return self._items.popleft()


class ReplicaClient:
    def __init__(self, index: int, launcher: Launcher) -> None:
        self.index = index
        self.launcher = launcher
        self.status: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.requests: dict[str, RemoteRequest] = {}  # live ones, by id
        self.families: list[Any] = []  # its metric families, as of the last refresh
        self.on_death: Callable[[str], None] | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._closing = False
        self._lost = False  # the connection ended: no new requests, whatever the last status said
        self._heard = 0.0  # the loop time of its last message

    # -- life cycle ---------------------------------------------------------------------

    async def start(self, args: EngineArgs, listener: ReplicaListener, timeout: float) -> None:
        """Launch the process and wait until its engine has started (its error if it did not)."""
        secret = os.urandom(SECRET_BYTES)
        connected = listener.expect(secret)
        level = logging.getLevelName(logging.getLogger("aiolm").getEffectiveLevel())
        self.launcher.launch(listener.address, secret, self.index, level)
        reader, writer = await self._unless_exited(connected, timeout, "connect")
        self._writer = writer
        write_message(writer, ("engine", args, self.index))
        msg = await self._unless_exited(asyncio.ensure_future(read_message(reader)), timeout, "start its engine")
        if msg[0] == "failed":
            raise msg[1]
        self.status = msg[1]
        self._heard = asyncio.get_running_loop().time()
        self._reading = asyncio.ensure_future(self._read(reader))
        self._watching = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Cut the connection of a replica whose process has ended or that went silent, so
        its requests fail now instead of waiting on a socket nobody will write to again."""
        loop = asyncio.get_running_loop()
        while self._writer is not None and not self._writer.is_closing():
            await asyncio.sleep(STATUS_PERIOD_S)
            why = self.launcher.exited()
            if why is None and loop.time() - self._heard > SILENT_LIMIT_S:
                why = f"sent nothing for {SILENT_LIMIT_S:g} s"
            if why is not None:
                log.error("data-parallel replica %d (%s) %s: dropping it", self.index, self.launcher.where(), why)
                self._lost = True
                self._writer.transport.abort()
                return

    async def _unless_exited(self, fut: asyncio.Future[Any], timeout: float, what: str) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                done, _ = await asyncio.wait([fut], timeout=0.2)
                if done:
                    try:
                        return fut.result()
                    except (asyncio.IncompleteReadError, ConnectionError):
                        pass  # the process is going: say how it ended
                why = self.launcher.exited()
                if why is not None:
                    raise EngineDeadError(f"data-parallel replica {self.index} {why} before it could {what}")
                if done:  # closed, not yet exited: wait for the exit (bounded by the deadline)
                    await asyncio.sleep(0.1)
                if loop.time() > deadline:
                    where = self.launcher.where()
                    raise EngineDeadError(
                        f"data-parallel replica {self.index} ({where}) did not {what} within {timeout:g} s"
                    )
        finally:
            fut.cancel()

    async def shutdown(self, grace: float = 30.0) -> None:
        """Ask the replica to stop (its engine shuts down, its workers end); kill it past ``grace``."""
        self._closing = True
        if self._writer is not None and not self._writer.is_closing():
            write_message(self._writer, ("shutdown",))
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()
        if self._reading is not None:
            await asyncio.wait([self._reading], timeout=grace)
        await self.launcher.stop(grace=1.0)
        for task in (self._reading, self._watching):
            if task is not None:
                task.cancel()
        if self._writer is not None:
            self._writer.close()
        self._died(self.dead_reason or "engine shut down")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                msg = await read_message(reader)
                self._heard = loop.time()
                kind = msg[0]
                if kind == "outputs":
                    for rid, out, error in msg[1]:
                        req = self.requests.get(rid)
                        if req is not None:
                            req.push(out, error)
                            if error is not None or out is None or out.finished:
                                del self.requests[rid]  # its last item: the reader has the rest
                elif kind == "reply":
                    fut = self._calls.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        if msg[2] is not None:
                            fut.set_exception(msg[2])
                        else:
                            fut.set_result(msg[3])
                elif kind == "status":
                    self.status = msg[1]
                elif kind == "dead":
                    # Its engine died: its streams end with their own errors, which follow;
                    # nothing new goes there, and calls waiting for a reply fail now.
                    reason = f"data-parallel replica {self.index}: {msg[1]}"
                    self._lost = True
                    self.status = {**self.status, "healthy": False, "why": msg[1]}
                    self._fail_calls(EngineDeadError(reason))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as e:  # a broken frame: the link cannot be trusted any further
            reason = f"data-parallel replica {self.index}: its link failed: {type(e).__name__}: {e}"
            log.exception("%s", reason)
        finally:
            self._lost = True
            if reason is None and not self._closing:
                await asyncio.sleep(0.2)  # let the process be reaped, so its exit can be told
                how = self.launcher.exited() or "closed its connection"
                reason = f"data-parallel replica {self.index} ({self.launcher.where()}) {how}"
            self._died(reason or "engine shut down")

    def _fail_calls(self, error: BaseException) -> None:
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()

    def _died(self, reason: str) -> None:
        if self.dead_reason is not None and not self.requests and not self._calls:
            return
        first = self.dead_reason is None
        self.dead_reason = self.dead_reason or reason
        self.status = {**self.status, "healthy": False}
        self.families = as_dead(self.families)
        error = EngineDeadError(self.dead_reason)
        for req in self.requests.values():
            req.push(None, error)
        self.requests.clear()
        self._fail_calls(error)
        if first and not self._closing:
            log.error("%s", self.dead_reason)
            if self.on_death is not None:
                self.on_death(self.dead_reason)

    # -- what routing and reporting read ----------------------------------------------------

    @property
    def available(self) -> bool:
        """Takes requests now: connected, its engine alive and neither recovering nor stalled."""
        return (
            self.dead_reason is None
            and self._reading is not None
            and not self._lost
            and bool(self.status.get("healthy"))
        )

    @property
    def live(self) -> int:
        """Sequences this front end sent there that have not finished."""
        return sum(r.n for r in self.requests.values())

    def health(self) -> tuple[bool, str | None]:
        if self.dead_reason is not None:
            return False, self.dead_reason
        return bool(self.status.get("healthy")), self.status.get("why")

    # -- requests ---------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        if self.dead_reason is not None or self._writer is None or self._writer.is_closing():
            raise EngineDeadError(self.dead_reason or f"data-parallel replica {self.index} is not connected")
        write_message(self._writer, message)

    def _call(self, kind: str, *args: Any) -> tuple[int, asyncio.Future[Any]]:
        """Send ``(kind, call, *args)`` (raises if it cannot go): the call's id and the future
        its reply settles."""
        call = next(self._ids)
        self._send((kind, call, *args))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call] = fut
        return call, fut

    async def call(self, kind: str, *args: Any, timeout: float | None = None) -> Any:
        """Send ``(kind, call, *args)`` and wait for the replica's reply (its error raised here)."""
        call, fut = self._call(kind, *args)
        try:
            return await wait_for(fut, timeout)
        finally:
            self._calls.pop(call, None)

    async def add_request(
        self, prompt: dict[str, Any], params: Any, rid: str, priority: int, timeout: float | None, lora: Any
    ) -> RemoteRequest:
        # Every add the replica gets ends with its end marker, refused ones too (or with the
        # replica's death): the entry leaves with it, so the id is not reused before the old
        # one ends there.
        req = self.requests[rid] = RemoteRequest(rid, params.n)
        try:
            call, fut = self._call("add", rid, prompt, params, priority, timeout, lora)
        except BaseException:
            del self.requests[rid]  # it never went
            raise
        try:
            await fut
        except asyncio.CancelledError:
            if self.dead_reason is None:  # given up while the replica adds it: it must not run on
                self.abort(rid)
            raise
        except BaseException:
            with contextlib.suppress(asyncio.TimeoutError):  # refused: the marker is right behind
                await wait_for(req.next(), 5.0)
            if self.requests.get(rid) is req:
                del self.requests[rid]
            raise
        finally:
            self._calls.pop(call, None)
        return req

    async def stream(self, req: RemoteRequest) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while True:
                out, error = await req.next()
                if error is not None:
                    finished = True
                    raise error
                if out is None:
                    finished = True
                    return
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            # An entry leaves ``requests`` with its last item (_read), or when the replica dies.
            if not finished and self.dead_reason is None:
                self.abort(req.req_id)

    def abort(self, rid: str) -> None:
        """Abort ``rid`` on the replica; its stream ends as an aborted request's does, with
        the replica's end marker (which also removes it from ``requests``)."""
        with contextlib.suppress(EngineDeadError):
            self._send(("abort", rid))

    async def refresh_metrics(self, timeout: float = 5.0) -> None:
        """Fetch its metric families and status, fresh (a scrape; the pushed status may be
        ``STATUS_PERIOD_S`` old)."""
        if self.dead_reason is not None:
            return
        try:
            families, status = await self.call("metrics", timeout=timeout)
        except Exception as e:  # one replica's trouble must not fail the whole scrape
            log.warning("replica %d's metrics were not refreshed: %s", self.index, e or "timed out")
            return
        if self.dead_reason is not None:  # it died while answering: its last word, as dead
            self.families = as_dead(families)
        else:
            self.families, self.status = families, status

    async def encode(
        self, rid: str, prompt: Any, params: Any, priority: int, truncate: int | None, timeout: float | None
    ) -> Any:
        """The replica's PoolingRequestOutput for one pooling request."""
        # Its answer comes as the call's reply: the entry only counts its load and holds its id.
        self.requests[rid] = RemoteRequest(rid, 1)
        try:
            return await self.call("encode", rid, prompt, params, priority, truncate, timeout)
        except asyncio.CancelledError:
            if self.dead_reason is None:
                self.abort(rid)  # the caller left: the replica stops pooling it
            raise
        finally:
            self.requests.pop(rid, None)
