"""One data-parallel replica in its own process: ``python -m aiolm.engine.replica``.

The process runs a whole AsyncEngine (scheduler, output processing and detokenizing,
its own workers) on its own event loop and serves the front end (data_parallel.py)
over one connection (replica_link.py). Why a process per replica: one replica's Python
(scheduling, detokenizing, sampling bookkeeping) never slows another's or the API
loop, so replicas add throughput the way separate servers would.

It ends, shutting its engine down (workers stopped, shared memory unlinked), when the
front end says so, when the connection closes (the front end died), when the process
that launched it dies, or after its engine died and its streams have been told.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.engine.errors import RequestError
from aiolm.engine.replica_link import (
    SECRET_ENV,
    STATUS_PERIOD_S,
    portable,
    read_message,
    write_message,
)
from aiolm.ipc.lifeline import exit_on_signals, parent_alive

log = logging.getLogger("aiolm.replica")


def replica_engine(args: EngineArgs, index: int) -> AsyncEngine:
    """Replica ``index``'s engine: one of ``args.data_parallel_size``, its workers on their
    own devices (``engine_index`` offsets them)."""
    return AsyncEngine(args.replica(), engine_index=index)


def status(engine: AsyncEngine) -> dict[str, Any]:
    """What the front end routes and reports by, as of now."""
    healthy, why = engine.health()
    running, waiting = engine.num_requests()
    sched = getattr(engine, "scheduler", None)
    pcs = sched.prefix_cache_stats if sched is not None else None
    return {
        "healthy": healthy,
        "why": why,
        "recovering": engine.recovering,
        "stalled": engine.stalled,
        "running": running,
        "waiting": waiting,
        "kv_usage": engine.kv_cache_usage(),
        "stats": dict(engine.stats),
        "prefix_queries": pcs.queries if pcs is not None else 0,
        "prefix_hits": pcs.hits if pcs is not None else 0,
        "pid": os.getpid(),
    }


class ReplicaServer:
    """Carries out the front end's messages on ``engine`` and sends back its outputs, in
    one frame per loop turn however many requests produced them."""

    def __init__(self, engine: AsyncEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.reader = reader
        self.writer = writer
        self.streams: dict[str, asyncio.Task[None]] = {}  # per live request, its pump
        self._adding: set[str] = set()  # ids whose add_request is still being awaited
        self._aborted_early: set[str] = set()  # of those, the ones the front end gave up on
        self._encoding: set[str] = set()  # ids of pooling requests (their pumps are cancelled on abort)
        self._outbox: list[tuple[str, Any, BaseException | None]] = []
        self._done = asyncio.Event()
        self._dead: str | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        if not self.writer.is_closing():
            write_message(self.writer, message)

    def _emit(self, item: tuple[str, Any, BaseException | None]) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(item)

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            self.send(("outputs", items))

    async def serve(self, parent_pid: int) -> None:
        self.engine.death_callbacks.append(self._on_death)
        tasks = [
            asyncio.ensure_future(self._read()),
            asyncio.ensure_future(self._report()),
            asyncio.ensure_future(self._watch_parent(parent_pid)),
        ]
        try:
            await self._done.wait()
        finally:
            for t in tasks:
                t.cancel()
            if self._dead is not None and self.streams:
                # Each stream ends with the engine's EngineDeadError: let the pumps say so.
                await asyncio.wait(list(self.streams.values()), timeout=5.0)
            for t in list(self.streams.values()):
                t.cancel()
            self._flush()
            await self.engine.shutdown()
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()
            self.writer.close()

    def _on_death(self, reason: str) -> None:
        self._dead = reason
        self.send(("dead", reason))
        self._done.set()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(STATUS_PERIOD_S)
            self.send(("status", status(self.engine)))
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()

    async def _watch_parent(self, parent_pid: int) -> None:
        while parent_alive(parent_pid):
            await asyncio.sleep(1.0)
        log.warning("the process that launched this replica is gone; shutting down")
        self._done.set()

    async def _read(self) -> None:
        try:
            while True:
                self._handle(await read_message(self.reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            log.info("the front end closed the connection; shutting down")
        finally:
            self._done.set()

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            self._adding.add(msg[2])
            self.streams[msg[2]] = asyncio.ensure_future(self._add(*msg[1:]))
        elif kind == "encode":
            self._encoding.add(msg[2])
            self.streams[msg[2]] = asyncio.ensure_future(self._encode(*msg[1:]))
        elif kind == "abort":
            self._abort(msg[1])
        elif kind in ("add_lora", "remove_lora", "metrics"):
            asyncio.ensure_future(self._call(msg[1], kind, *msg[2:]))
        elif kind == "shutdown":
            self._done.set()
        else:
            log.error("unknown message from the front end: %r", kind)

    def _abort(self, rid: str) -> None:
        """Abort through the engine, so the request's stream ends as an aborted one does (a
        consumer on the front end may still be reading it): an add still being awaited is
        aborted once it is in, and its end marker follows either way. A pooling request
        answers with its reply alone, which the front end no longer waits for: its pump is
        cancelled, before the engine has it (nothing runs) or after (leaving its stream aborts it)."""
        if rid in self._adding:
            self._aborted_early.add(rid)
        elif rid in self._encoding:
            self._encoding.discard(rid)
            self.streams.pop(rid).cancel()
        elif rid in self.streams:
            asyncio.ensure_future(self.engine.abort(rid))

    def _added(self, rid: str) -> bool:
        """Past add_request: False if the front end gave up meanwhile."""
        self._adding.discard(rid)
        if rid in self._aborted_early:
            self._aborted_early.discard(rid)
            return False
        return True

    async def _add(self, call: int, rid: str, prompt: Any, params: Any, priority: int, timeout: Any, lora: Any) -> None:
        try:
            state = await self.engine.add_request(prompt, params, rid, priority, timeout, lora)
        except Exception as e:
            self._added(rid)
            self.streams.pop(rid, None)
            self.send(("reply", call, portable(e), None))
            self._emit((rid, None, None))  # every add ends with a marker: the front end's entry goes with it
            return
        self.send(("reply", call, None, None))
        if not self._added(rid):
            self.streams.pop(rid, None)
            await self.engine.abort(rid)
            self._emit((rid, None, None))  # the front end's entry for it ends here
            return
        try:
            async with contextlib.aclosing(self.engine.stream(state)) as outputs:
                async for out in outputs:
                    self._emit((rid, out, None))
            self._emit((rid, None, None))
        except Exception as e:
            self._emit((rid, None, portable(e)))
        finally:
            if self.streams.get(rid) is asyncio.current_task():
                del self.streams[rid]

    async def _encode(
        self, call: int, rid: str, prompt: Any, params: Any, priority: int, truncate: Any, timeout: Any
    ) -> None:
        try:
            result = None
            async with contextlib.aclosing(
                self.engine.encode(prompt, params, rid, priority, truncate, timeout)
            ) as outputs:
                async for out in outputs:
                    result = out
            self.send(("reply", call, None, result))
        except asyncio.CancelledError:  # aborted (_abort): a front end still waiting (a drain's abort) hears why
            self.send(("reply", call, portable(RequestError(f"request {rid!r} was aborted")), None))
            raise
        except Exception as e:
            self.send(("reply", call, portable(e), None))
        finally:
            if self.streams.get(rid) is asyncio.current_task():
                del self.streams[rid]
                self._encoding.discard(rid)

    async def _call(self, call: int, kind: str, *args: Any) -> None:
        try:
            value: Any = None
            if kind == "add_lora":
                await self.engine.add_lora(args[0])
            elif kind == "remove_lora":
                value = await self.engine.remove_lora(args[0])
            else:
                if self.engine.expert_tokens:
                    await self.engine.expert_load()  # fresh routing counts into the families
                value = list(self.engine.metrics.registry.collect()), status(self.engine)
        except Exception as e:
            self.send(("reply", call, portable(e), None))
            return
        self.send(("reply", call, None, value))


async def run_replica(host: str, port: int, secret: bytes, index: int, parent_pid: int) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(secret)
    kind, args, index = await read_message(reader)
    assert kind == "engine", kind
    engine = replica_engine(args, index)
    try:
        await engine.start()
    except Exception as e:
        log.error("replica %d did not start: %s", index, e)
        write_message(writer, ("failed", portable(e)))
        await engine.shutdown()
        await writer.drain()
        writer.close()
        return 1
    write_message(writer, ("ready", status(engine)))
    await ReplicaServer(engine, reader, writer).serve(parent_pid)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiolm.engine.replica", description=__doc__.splitlines()[0])
    p.add_argument("--connect", required=True, help="HOST:PORT of the front end")
    p.add_argument("--index", type=int, required=True, help="the replica's number")
    p.add_argument("--parent-pid", type=int, required=True, help="exit when this process is gone")
    p.add_argument("--log-level", default="WARNING")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV))  # not handed on to the workers
    logging.basicConfig(level=a.log_level, format=f"%(asctime)s replica{a.index} %(levelname)s %(name)s: %(message)s")
    exit_on_signals()
    # Ctrl-C reaches the whole process group; the front end decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    host, _, port = a.connect.rpartition(":")
    from aiolm.cli import run_on_uvloop

    return int(run_on_uvloop(run_replica(host, int(port), secret, a.index, a.parent_pid)))


if __name__ == "__main__":
    sys.exit(main())
