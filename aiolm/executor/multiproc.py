"""Worker processes fed through shared-memory rings, one process per rank.

Workers are started with subprocess as ``python -m aiolm.worker`` (never fork or
multiprocessing spawn, which would re-import the user's ``__main__``). One
request ring broadcasts each step to every rank; each rank answers on its own
response ring, which the engine awaits on its event loop. A monitor task notices
a dead worker within a fraction of a second, and a worker that stops beating
(ipc/heartbeat.py: stopped, frozen, starved) within a few seconds, which makes the
executor ``stalled`` (the engine's /health says so) until it beats again. A step
that outlasts its limit (step_watch.py: scaled by its tokens and the measured
rate) marks its workers hung, naming the rank that stopped or fell behind, and a
worker whose step raised sends its traceback back through the response ring.
Each of these but a stall makes the executor unusable and tells ``on_death``;
the engine's recovery (aiolm/engine/recovery.py) then replaces the whole worker
set with a new executor.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from aiolm.config import RunnerConfig
from aiolm.core.step import ModelRunnerOutput, SchedulerOutput
from aiolm.distributed.stages import answering_rank
from aiolm.executor.base import Executor, ExecutorError
from aiolm.executor.step_watch import StepWatch
from aiolm.ipc import codec
from aiolm.ipc.heartbeat import HeartbeatBoard
from aiolm.ipc.shm_ring import PeerDied, RingClosed, RingHandle, ShmRing
from aiolm.ipc.stale import sweep_stale_segments

log = logging.getLogger(__name__)

# Poll a step's response this long before sleeping on the wake socket: it holds the loop
# for at most this long per step, and a reply that lands meanwhile costs no wake-up
# (a socket read and a loop turn), which short decode steps would otherwise each pay.
# benchmarks/bench_ipc.py --spin-us measures the round trip with a given spin.
RESPONSE_SPIN_S = 100e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MultiprocExecutor(Executor):
    def __init__(
        self,
        cfg: RunnerConfig,
        world_size: int = 1,
        startup_timeout: float = 600.0,
        on_death: Callable[[str], None] | None = None,
        step_watch: StepWatch | None = None,
        incarnation: int = 0,
        all_reduce: str = "auto",
        cpu_bind: str = "auto",
        pipeline_size: int = 1,
    ) -> None:
        """``world_size`` ranks split each layer (tensor parallel) in each of ``pipeline_size``
        stages, which split the layers: world_size * pipeline_size processes in all."""
        self.cfg = cfg
        self.step_watch = step_watch  # None: no step time limit
        self.heartbeats: HeartbeatBoard | None = None
        self._stalled: str | None = None  # why, while a rank does not beat
        self._stalls = 0  # stalls begun so far: a step that saw one is not a measure of the rate
        # Scheduled tokens of each submitted step whose result is not read yet, by handle.
        self._step_tokens: dict[asyncio.Future[bytes], int] = {}
        self.incarnation = incarnation  # how many worker sets came before this one (for logs)
        self.tp_size = world_size
        self.pipeline_size = pipeline_size
        self.world_size = world_size * pipeline_size  # every rank of every stage
        self.answering = answering_rank(self.world_size, pipeline_size)  # the rank that answers steps
        self.all_reduce_requested = all_reduce
        self.cpu_bind = cpu_bind
        self.all_reduce: str | None = None  # what the ranks run, from their handshake
        # the CPU all-reduce segment of each stage, owned here (None: that stage has none)
        self.all_reduce_shms: list[str | None] = [None] * pipeline_size
        self._unlink_shm: list[Callable[[], bool]] = []
        self.stage_links: list[RingHandle] = []  # stage s rank t -> stage s+1 rank t, at s * T + t
        self.block_size = cfg.block_size
        self.startup_timeout = startup_timeout
        self.on_death = on_death
        self.procs: list[subprocess.Popen[bytes]] = []
        self.requests: ShmRing | None = None
        self.responses: list[ShmRing] = []
        self._monitor: asyncio.Task[None] | None = None
        self._dead: str | None = None
        self._detail: str | None = None
        self._lock = asyncio.Lock()  # one sender at a time: replies are awaited in send order
        self._stopping: asyncio.Future[None] | None = None  # the stop, once begun (_stop)
        # Per rank, a future for each reply it still owes, oldest first. A rank answers in
        # the order it was sent to, so whoever reads a reply hands it to the oldest future:
        # steps may queue behind each other (overlap scheduling), an rpc may follow them,
        # and a caller cancelled while waiting leaves a future nobody reads, not a stray reply.
        self._owed: list[collections.deque[asyncio.Future[bytes]]] = [
            collections.deque() for _ in range(self.world_size)
        ]
        self._readers = [asyncio.Lock() for _ in range(self.world_size)]

    async def start(self) -> None:
        sweep_stale_segments()
        self.requests = ShmRing.create(num_readers=self.world_size, num_slots=8, slot_size=1 << 20)
        self.responses = [
            ShmRing.create(num_readers=1, num_slots=4, slot_size=1 << 18, reader_rank=0) for _ in range(self.world_size)
        ]
        self.heartbeats = HeartbeatBoard(self.world_size)
        tp = self.tp_size
        ports = [_free_port() if tp > 1 else 0 for _ in range(self.pipeline_size)]
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # libgomp's threads spin for milliseconds after each parallel region by default,
        # so between steps they hold the cores that the engine loop and the worker's own
        # main thread need in order to wake up. A short spin still bridges the gaps between
        # the parallel regions of one forward pass, so the pass does not pay for waking its
        # threads either (docs/benchmarks.md has the IPC time with and without). A user's
        # setting wins.
        env.setdefault("GOMP_SPINCOUNT", "10000")
        try:
            self._make_all_reduce_segments()
            self._make_stage_links()
            for rank in range(self.world_size):
                stage, shm = rank // tp, self.all_reduce_shms[rank // tp]
                cmd = [
                    sys.executable,
                    "-m",
                    "aiolm.worker",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(self.world_size),
                    "--request-ring",
                    str(self.requests.handle()),
                    "--response-ring",
                    str(self.responses[rank].handle()),
                    "--parent-pid",
                    str(os.getpid()),
                    "--dist-port",
                    str(ports[stage]),
                    "--heartbeat",
                    self.heartbeats.name,
                    "--all-reduce",
                    self.all_reduce_requested,
                    "--cpu-bind",
                    self.cpu_bind,
                    *(["--all-reduce-shm", shm] if shm else []),
                    *self._stage_args(rank),
                    "--config",
                    self.cfg.encode(),
                ]
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
            infos = await self._handshakes()
        except BaseException:
            # Workers that are still loading will not read a shutdown message soon.
            await self._stop(grace=0.5)
            raise
        self.num_blocks = min(i["num_blocks"] for i in infos)
        self.block_bytes = max(int(i.get("block_bytes", 0)) for i in infos)
        self.all_reduce = str(infos[0].get("all_reduce"))
        if self.tp_size > 1:
            log.info("%d tensor-parallel ranks, all-reduce: %s", self.tp_size, self.all_reduce)
        if self.pipeline_size > 1:
            log.info("%d pipeline stages of %d rank(s) each", self.pipeline_size, self.tp_size)
        if self.incarnation:
            log.info("worker set %d started: pids %s", self.incarnation, [p.pid for p in self.procs])
        self._monitor = asyncio.get_running_loop().create_task(self._watch())

    def _make_all_reduce_segments(self) -> None:
        """Each stage's CPU all-reduce segment (communicator.py decides who uses it).

        Created here so that each name has one owner that outlives every rank: a
        SIGKILLed rank leaves nothing behind, and shutdown unlinks them.
        """
        from aiolm.distributed.communicator import check_for_device, requested_all_reduce

        requested = requested_all_reduce(self.all_reduce_requested)
        self.all_reduce_requested = requested
        device_type = self.cfg.device.split(":", 1)[0]
        check_for_device(requested, device_type)
        if self.tp_size == 1 or device_type != "cpu" or requested not in ("auto", "shm"):
            return
        from aiolm.distributed.shm_allreduce import create_segment

        for stage in range(self.pipeline_size):
            try:
                name, unlink = create_segment(self.tp_size)
            except OSError as e:
                if requested == "shm":
                    raise ExecutorError(f"cannot create the shared-memory all-reduce segment: {e}") from e
                log.warning("no shared-memory all-reduce (%s); the ranks fall back to gloo", e)
                return
            self.all_reduce_shms[stage] = name
            self._unlink_shm.append(unlink)

    @property
    def all_reduce_shm(self) -> str | None:
        """The first stage's all-reduce segment (the only one without a pipeline)."""
        return self.all_reduce_shms[0]

    def _make_stage_links(self) -> None:
        """The rings that carry activations from each pipeline stage to the next, one per
        tensor-parallel rank (distributed/stage_link.py). Small slots: a decode step's
        activations fit one, and a prompt chunk's stream through the ring."""
        for _ in range((self.pipeline_size - 1) * self.tp_size):
            self.stage_links.append(ShmRing.create_between(num_readers=1, num_slots=4, slot_size=1 << 20))

    def _stage_args(self, rank: int) -> list[str]:
        """A worker's pipeline flags: the stage count and its rings to its neighbours."""
        if self.pipeline_size == 1:
            return []
        tp = self.tp_size
        stage, t = divmod(rank, tp)
        args = ["--pipeline-size", str(self.pipeline_size)]
        if stage > 0:
            args += ["--stage-recv", str(self.stage_links[(stage - 1) * tp + t])]
        if stage < self.pipeline_size - 1:
            args += ["--stage-send", str(self.stage_links[stage * tp + t])]
        return args

    async def _handshakes(self) -> list[dict[str, int]]:
        """Every rank's ready message; the first failure (or the timeout) cancels the rest."""
        tasks = [asyncio.ensure_future(self._handshake(r)) for r in range(self.world_size)]
        try:
            done, pending = await asyncio.wait(tasks, timeout=self.startup_timeout, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if pending:
                ranks = [r for r, t in enumerate(tasks) if not t.done()]
                raise ExecutorError(f"worker(s) {ranks} did not report ready within {self.startup_timeout:g} s")
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _handshake(self, rank: int) -> dict[str, int]:
        while True:
            try:
                buf = await self.responses[rank].read_async(timeout=0.5)
                break
            except TimeoutError:
                code = self.procs[rank].poll()
                if code is not None:
                    raise ExecutorError(f"worker {rank} exited with code {code} during start-up") from None
            except (PeerDied, RingClosed) as e:
                raise ExecutorError(f"worker {rank} died during start-up") from e
        msg = codec.decode(buf)
        if msg[0] != "ready":
            raise ExecutorError(f"worker {rank} failed to start: {msg[1]}")
        return msg[1]

    async def _watch(self) -> None:
        while not self._closed:
            if self._exited() is not None and not self._closed:
                self._fail(await self._death_reason("a worker exited"))
                return
            self._check_heartbeats()
            await asyncio.sleep(0.2)

    def _check_heartbeats(self) -> None:
        """Enter or leave the stalled state as the ranks stop or resume beating; say so in the log."""
        if self.heartbeats is None or self._dead is not None:
            return
        silent = self.heartbeats.stalled()
        if silent:
            why = "; ".join(f"worker {r} (pid {self.procs[r].pid}) has not beaten for {age:.1f} s" for r, age in silent)
            if self._stalled is None:
                self._stalls += 1
                log.warning("stalled: %s (stopped, frozen or starved of CPU?); requests wait", why)
            self._stalled = why
        elif self._stalled is not None:
            log.warning("no longer stalled: every worker beats again")
            self._stalled = None

    @property
    def stalled(self) -> str | None:
        """Why the workers cannot make progress now (a rank stopped beating), else None."""
        return self._stalled if self._dead is None and not self._closed else None

    async def _death_reason(self, fallback: str, wait_s: float = 0.5) -> str:
        """Why the workers are failing, once the cause can be named: a rank killed by a
        signal takes a moment to become reapable (its threads are still being torn down)
        while its peers may already have noticed, exited or closed their rings."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            codes = [p.poll() for p in self.procs]
            done = any(c is not None and c < 0 for c in codes) or all(c is not None for c in codes)
            if done or loop.time() >= deadline:
                return self._exited() or fallback
            await asyncio.sleep(0.02)

    def _exited(self) -> str | None:
        """Which workers have exited, one killed by a signal first: when a rank dies, its
        tensor-parallel peers exit right after it on losing it, and the cause is the first.
        None while all run."""
        exited = [(r, p.pid, p.poll()) for r, p in enumerate(self.procs)]
        exited = sorted((e for e in exited if e[2] is not None), key=lambda e: (e[2] >= 0, e[0]))  # type: ignore[operator]
        if not exited:
            return None
        return "; ".join(f"worker {r} (pid {pid}) exited with code {code}" for r, pid, code in exited)

    def _fail(self, reason: str, detail: str | None = None) -> None:
        if self._dead is None:
            self._dead = reason
            self._detail = detail
            log.error("%s", reason)
            if self.on_death is not None:
                self.on_death(reason)

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed

    def _check(self) -> None:
        if self._dead is not None:
            raise ExecutorError(self._dead, self._detail)
        if self._closed or self.requests is None:
            raise ExecutorError("executor is shut down")

    async def _send(self, data: bytes, responders: range | list[int]) -> list[asyncio.Future[bytes]]:
        """Broadcast ``data``; one future per responding rank for its reply (see ``_owed``).
        Callers hold ``_lock``, so futures are queued in the order the ranks read."""
        self._check()
        assert self.requests is not None
        try:
            if any(self._owed) and not self.requests.fits(len(data)):
                await self._write_reading_replies(data)
            else:
                await self.requests.write_async(data)
        except (PeerDied, RingClosed) as e:
            self._fail(await self._death_reason(f"a worker died: {e}"))
            raise ExecutorError(self._dead or str(e)) from e
        loop = asyncio.get_running_loop()
        replies = []
        for rank in responders:
            fut: asyncio.Future[bytes] = loop.create_future()
            self._owed[rank].append(fut)
            replies.append(fut)
        return replies

    async def _write_reading_replies(self, data: bytes) -> None:
        """Write a message the request ring has no room for yet, reading the replies owed
        meanwhile. Its room comes as the ranks read it, and a rank may be writing an earlier
        step's reply (overlap scheduling) into a response ring only this process empties: a
        reply bigger than that ring (prompt logprobs of a long prefill) waits for it to be
        read, and waiting for room alone left both sides waiting on each other for good."""
        assert self.requests is not None
        write = asyncio.ensure_future(self.requests.write_async(data))
        reading: dict[int, asyncio.Future[bytes]] = {}
        try:
            while not write.done():
                for rank, owed in enumerate(self._owed):
                    if owed and rank not in reading:
                        tokens = self._step_tokens.get(owed[0])  # None: an rpc's reply, read without a limit
                        limit = self.step_watch.limit(tokens) if self.step_watch and tokens is not None else 0.0
                        reading[rank] = asyncio.ensure_future(self._recv(rank, owed[0], limit, tokens or 0))
                done, _ = await asyncio.wait({write, *reading.values()}, return_when=asyncio.FIRST_COMPLETED)
                for rank, task in list(reading.items()):
                    if task in done:
                        del reading[rank]
                        task.result()  # a worker's death or hang, as an ExecutorError
        except BaseException:
            write.cancel()  # the rings die with the workers: a half-written message is no matter
            raise
        finally:
            for task in reading.values():  # each hands its reply to its future when it comes
                task.add_done_callback(_retrieved)
        write.result()

    async def _recv(self, rank: int, reply: asyncio.Future[bytes], timeout: float = 0.0, tokens: int = 0) -> bytes:
        """The rank's answer for ``reply``, reading (and handing out) the replies owed before it.
        With ``timeout``, waiting longer for a step of ``tokens`` tokens counts as a hang."""
        while not reply.done():
            async with self._readers[rank]:
                if reply.done():
                    break
                buf = await self._read(rank, timeout, tokens)
                fut = self._owed[rank].popleft()
                if not fut.done():  # done: its caller was cancelled and gave it up
                    fut.set_result(buf)
        return reply.result()

    async def _read(self, rank: int, timeout: float, tokens: int = 0) -> bytes:
        """Rank's next reply; with ``timeout`` > 0 a worker silent that long counts as hung."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout > 0 else None
        while True:
            self._check()
            if deadline is not None and loop.time() > deadline:
                culprit, reason = self._hang(timeout, tokens)
                self._fail(reason)
                self.procs[culprit].kill()  # SIGKILL ends a stopped process too; its peers follow it
                continue
            try:
                return await self.responses[rank].read_async(timeout=0.5, spin_s=RESPONSE_SPIN_S)
            except TimeoutError:
                if self.procs[rank].poll() is not None:
                    self._fail(await self._death_reason(f"worker {rank} exited"))
            except (PeerDied, RingClosed) as e:
                self._fail(await self._death_reason(f"worker {rank} died: {e}"))

    def _hang(self, timeout: float, tokens: int) -> tuple[int, str]:
        """(the rank to blame, why) when a step of ``tokens`` got no answer within ``timeout``:
        a rank that stopped beating first, else the one that finished the fewest steps (its
        peers finished theirs and wait for it), else rank 0."""
        step = f"a step of {tokens} tokens got no answer within {timeout:.1f} s"
        board = self.heartbeats
        silent = board.stalled() if board is not None else []
        if silent:
            rank, age = max(silent, key=lambda s: s[1])
            return rank, (
                f"worker {rank} (pid {self.procs[rank].pid}) stopped: no heartbeat for {age:.1f} s, "
                f"and {step} (--step-timeout)"
            )
        steps = [board.steps(r) for r in range(self.world_size)] if board is not None else [0]
        rank = steps.index(min(steps))
        predicted = self.step_watch.predict(tokens) if self.step_watch is not None else None
        expected = f"; the measured rate predicts {predicted:.2f} s" if predicted is not None else ""
        beats = "it beats, but " if board is not None else ""
        return rank, (f"worker {rank} (pid {self.procs[rank].pid}) is hung: {beats}{step}{expected} (--step-timeout)")

    async def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return await self.result(await self.submit(step))

    async def submit(self, step: SchedulerOutput) -> asyncio.Future[bytes]:
        async with self._lock:
            handle = (await self._send(codec.encode_scheduler_output(step), [self.answering]))[0]
        self._step_tokens[handle] = step.total_num_scheduled_tokens
        return handle

    async def result(self, handle: Any) -> ModelRunnerOutput:
        tokens = self._step_tokens.get(handle, 0)
        watch = self.step_watch
        stalls = self._stalls if self._stalled is None else -1
        try:
            buf = await self._recv(self.answering, handle, watch.limit(tokens) if watch is not None else 0.0, tokens)
        finally:
            self._step_tokens.pop(handle, None)
        runner_output = self._step_result(codec.decode(buf))
        clock = runner_output.worker_clock
        if watch is not None and clock and self._stalls == stalls:  # a stalled step measures the stall
            watch.observe(tokens, clock[1] - clock[0])
        return runner_output

    def abandon(self, handle: Any) -> None:
        self._step_tokens.pop(handle, None)
        super().abandon(handle)

    def _step_result(self, msg: Any, rank: int | None = None) -> ModelRunnerOutput:
        """A rank's decoded answer to a step (by default the answering rank's): its output, or
        else an ExecutorError."""
        rank = self.answering if rank is None else rank
        if isinstance(msg, ModelRunnerOutput):
            return msg
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            # The worker's step raised; it sent the cause and exits.
            self._fail(f"worker {rank} failed in a step: {msg[1]}", msg[2] if len(msg) > 2 else None)
            raise ExecutorError(self._dead or msg[1], self._detail)
        raise ExecutorError(f"worker {rank} answered a step with {type(msg).__name__}")

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        async with self._lock:
            replies = await self._send(codec.encode_rpc(method, args, kwargs), range(self.world_size))
        results = []
        for rank, reply in enumerate(replies):
            msg = codec.decode(await self._recv(rank, reply))
            if msg[0] != "ok":
                raise ExecutorError(f"rpc {method!r} failed on worker {rank}: {msg[1]}")
            results.append(msg[1])
        return results

    @property
    def _closed(self) -> bool:
        """Shut down, or shutting down: no step or rpc goes to the workers any more."""
        return self._stopping is not None

    async def shutdown(self) -> None:
        # A failed set has nothing worth waiting for: survivors get a short grace.
        await self._stop(grace=5.0 if self._dead is None else 1.0)

    async def _stop(self, grace: float) -> None:
        """Stop the workers and free the shared memory, once. The stop runs as its own task to
        its end: a caller cancelled meanwhile (a recovery cut short by the engine's shutdown, a
        start given up) leaves it running, and a later call waits for the same task."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_now(grace))
        await asyncio.shield(self._stopping)

    async def _stop_now(self, grace: float) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        if self.requests is not None:
            if self._dead is None:
                try:
                    await self.requests.write_async(codec.encode(codec.SHUTDOWN), timeout=1.0)
                except Exception:
                    pass
            # Closing the writer end also tells workers that never get the message
            # (survivors of a dead rank) to exit: their read raises RingClosed.
            self.requests.close()
        await self._stop_workers(grace)
        for ring in [self.requests, *self.responses]:
            if ring is not None:
                ring.close()
                ring.unlink()
        if self.heartbeats is not None:
            self.heartbeats.close()
        for handle in self.stage_links:
            handle.unlink()
        for unlink in self._unlink_shm:
            unlink()

    async def _stop_workers(self, grace: float) -> None:
        """Wait ``grace`` for each worker to leave (the rings are closed), then end it."""
        for p in self.procs:
            await reap(p, grace)


def _retrieved(task: asyncio.Future[bytes]) -> None:
    """A reading task nobody awaits: its failure reaches the step's caller through the executor."""
    if not task.cancelled():
        task.exception()


async def reap(p: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait up to ``timeout`` for ``p`` to end, then terminate it, then kill it (each given
    ``timeout``)."""
    loop = asyncio.get_running_loop()
    for sig in (None, "terminate", "kill"):
        if sig is not None and p.poll() is None:
            getattr(p, sig)()
        deadline = loop.time() + timeout
        while p.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if p.poll() is not None:
            return
