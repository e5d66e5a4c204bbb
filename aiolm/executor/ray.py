"""Workers as Ray actors, on one node or across a cluster (``--distributed-executor-backend ray``).

The engine's shape does not change: the event loop, scheduler and output
processing stay in this process; only the ranks move into Ray actors
(executor/ray_worker.py), placed by a placement group with one bundle per rank
(strategy PACK: as few nodes as fit). After placement the ranks are numbered so
that the ones on the engine's own node come first, and each rank gets the
transport its place allows:

- a rank on this node reads every step from the same shared-memory request ring
  as a worker process, and rank 0 answers on its response ring, so the local
  path costs what the multiproc executor costs;
- a rank on another node gets the encoded step as the argument of a Ray call
  (``RayWorker.handle``; Ray inlines small arguments in the task, so no object
  store round trip) and returns its answer the same way.

The tensor-parallel group spans nodes: its rendezvous is rank 0's node address.
The shared-memory all-reduce needs every rank on one node, so a group that spans
nodes runs gloo (CPU) or NCCL (CUDA) instead. ``AIOLM_RAY_REMOTE_RANKS=k`` makes
the last k ranks count as being on another node although they are not, which is
how the cross-node path runs on one machine (tests, benchmarks).

Failures: each actor holds a pending ``lifeline`` call that only a clean stop
ends; Ray fails it when the actor's process or node dies, and the executor then
fails (``on_death``) exactly like a multiproc executor losing a worker, so the
engine's recovery rules apply unchanged. Every wait is bounded: ring reads check
liveness every 0.5 s, Ray calls run under the step timeout. ``shutdown`` stops the
ranks, kills the actors, waits for their deaths and removes the placement group.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiolm.config import RunnerConfig
from aiolm.core.step import ModelRunnerOutput, SchedulerOutput
from aiolm.executor.base import ExecutorError
from aiolm.executor.multiproc import MultiprocExecutor
from aiolm.executor.placement import placement_strategy
from aiolm.executor.step_watch import StepWatch
from aiolm.ipc import codec
from aiolm.ipc.shm_ring import ShmRing
from aiolm.ipc.stale import sweep_stale_segments
from aiolm.ipc.wakeup import pid_alive
from aiolm.timeouts import in_daemon_thread, wait_for

log = logging.getLogger(__name__)

REMOTE_RANKS_ENV = "AIOLM_RAY_REMOTE_RANKS"
# Passed on to actors, whose environment comes from their raylet, not from this process.
_ENV_PREFIXES = ("AIOLM_", "GOMP_", "OMP_", "KMP_", "MKL_", "TORCH_")


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ExecutorError("the ray executor needs Ray: pip install 'aiolm[ray]'") from e
    return ray


async def _wait_ref(ref: Any) -> Any:
    """An ObjectRef awaited on any event loop (uvloop included), through its concurrent future."""
    return await asyncio.wrap_future(ref.future())


class _Rank:
    """One actor seen the way the multiproc executor sees a process: pid, poll(), kill()."""

    def __init__(self, actor: Any, info: dict[str, Any], local: bool, same_node: bool) -> None:
        self.actor = actor
        self.pid = int(info["pid"])
        self.ip = str(info["ip"])
        self.node_id = str(info["node_id"])
        self.local = local  # served through the rings
        self.same_node = same_node  # its pid can be watched from here
        self.lifeline: asyncio.Future[Any] | None = None
        self.serving: asyncio.Future[Any] | None = None  # local ranks: the ring loop's call

    def poll(self) -> int | None:
        """None while the rank runs; else its exit status (the signal's negative when killed)."""
        for fut in (self.lifeline, self.serving):
            if fut is not None and fut.done():
                if fut.cancelled() or fut.exception() is not None:
                    return -9
                return int(fut.result() or 0)
        if self.same_node and not pid_alive(self.pid):
            return -9
        return None

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)

    def where(self) -> str:
        return f"pid {self.pid} on {self.ip}" + ("" if self.local else " (Ray transport)")


class _Step:
    """A submitted step: its tokens, the ring rank's reply owed (or None) and the Ray calls."""

    def __init__(self, tokens: int, local: asyncio.Future[bytes] | None, remote: dict[int, asyncio.Future[Any]]):
        self.tokens = tokens
        self.local = local
        self.remote = remote


class RayExecutor(MultiprocExecutor):
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
        address: str | None = None,
        min_cluster_cpus: int = 0,
        pipeline_size: int = 1,
        placement: str = "auto",
    ) -> None:
        super().__init__(
            cfg, world_size, startup_timeout, on_death, step_watch, incarnation, all_reduce, cpu_bind, pipeline_size
        )
        self.address = address
        self.min_cluster_cpus = max(min_cluster_cpus, self.world_size)
        self.placement = placement_strategy(placement, pipeline_size)
        self.ranks: list[_Rank] = []
        self.num_local = 0
        self._seq = 0  # the next message's place in the Ray ranks' order
        self._pg: Any = None

    # -- start-up -----------------------------------------------------------------------

    async def start(self) -> None:
        from aiolm.executor import ray_cluster

        ray = _ray()
        await asyncio.to_thread(ray_cluster.connect, self.address, self.min_cluster_cpus)
        sweep_stale_segments()
        try:
            await wait_for(self._start(ray), self.startup_timeout)
        except BaseException as e:
            await self._stop(grace=0.5)
            if isinstance(e, asyncio.TimeoutError):
                raise ExecutorError(
                    f"the Ray workers did not report ready within {self.startup_timeout:g} s "
                    f"(does the cluster have {self.world_size} free bundles of "
                    f"{self._bundle()}?)"
                ) from None
            if isinstance(e, ExecutorError) or not isinstance(e, Exception):
                raise
            raise ExecutorError(
                f"starting the Ray workers failed: {type(e).__name__}: {e}", getattr(e, "traceback_str", None)
            ) from e
        self.num_blocks = min(i["num_blocks"] for i in self._infos)
        self.block_bytes = max(int(i.get("block_bytes", 0)) for i in self._infos)
        self.all_reduce = str(self._infos[0].get("all_reduce"))
        log.info(
            "%d Ray rank(s), %d on this node (shm rings), %d through Ray calls; all-reduce: %s",
            self.world_size,
            self.num_local,
            self.world_size - self.num_local,
            self.all_reduce,
        )
        self._monitor = asyncio.get_running_loop().create_task(self._watch_actors())

    def _bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.cfg.device.startswith("cuda") else {"CPU": 1.0}

    async def _start(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from aiolm.executor.ray_worker import MAX_CONCURRENCY, RayWorker

        tp, pp = self.tp_size, self.pipeline_size
        bundle = self._bundle()
        if pp > 1:  # one bundle per stage: its tensor-parallel ranks land on one node together
            bundles = [{k: v * tp for k, v in bundle.items()}] * pp
            bundle_of = [rank // tp for rank in range(self.world_size)]
        else:
            bundles, bundle_of = [bundle] * self.world_size, list(range(self.world_size))
        self._pg = placement_group(bundles, strategy=self.placement)
        await _wait_ref(self._pg.ready())
        cls = ray.remote(RayWorker)
        actors = [
            cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_concurrency=MAX_CONCURRENCY + max(pp, 2) + 1,  # the steps in flight and an RPC
                runtime_env=_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=bundle_of[i]
                ),
            ).remote()
            for i in range(self.world_size)
        ]
        infos = await asyncio.gather(*(_wait_ref(a.node_info.remote()) for a in actors))
        here = ray.get_runtime_context().get_node_id()
        forced = _forced_remote(self.world_size)
        if pp > 1:
            # Ranks stay stage by stage; those on this node from rank 0 on read the rings.
            order = list(range(self.world_size))
            near = [infos[i]["node_id"] == here for i in order]
            prefix = next((r for r, n in enumerate(near) if not n), self.world_size)
            local = [r < min(prefix, self.world_size - forced) for r in range(self.world_size)]
        else:
            # Ranks on this node first (stable in bundle order), so they are 0..num_local-1.
            order = sorted(range(self.world_size), key=lambda i: infos[i]["node_id"] != here)
            local = [infos[i]["node_id"] == here and r < self.world_size - forced for r, i in enumerate(order)]
        self.ranks = [
            _Rank(actors[i], infos[i], local=local[r], same_node=infos[i]["node_id"] == here)
            for r, i in enumerate(order)
        ]
        self.num_local = sum(r.local for r in self.ranks)
        for r in self.ranks:
            r.lifeline = asyncio.ensure_future(_wait_ref(r.actor.lifeline.remote()))
        self.procs = self.ranks  # type: ignore[assignment]  # what the inherited waits poll
        single_node = self.num_local == self.world_size
        all_reduce = self._group_all_reduce(single_node)
        if self.num_local:
            self.requests = ShmRing.create(num_readers=self.num_local, num_slots=8, slot_size=1 << 20)
            self.responses = [
                ShmRing.create(num_readers=1, num_slots=4, slot_size=1 << 18, reader_rank=0)
                for _ in range(self.num_local)
            ]
        firsts = [self.ranks[s * tp] for s in range(pp)]  # each stage's rendezvous is its first rank's node
        ports = await asyncio.gather(
            *(_wait_ref(r.actor.free_port.remote()) if tp > 1 else asyncio.sleep(0, 0) for r in firsts)
        )
        # A later stage's ranks listen for the link from the stage before (stages may sit on
        # different nodes: TCP; distributed/stage_link.py).
        listening = await asyncio.gather(
            *(_wait_ref(r.actor.listen_for_stage.remote()) for r in self.ranks[tp:] if pp > 1)
        )
        cfg_text = self.cfg.encode()
        self._infos = await asyncio.gather(
            *(
                _wait_ref(
                    r.actor.setup.remote(
                        cfg_text,
                        rank,
                        self.world_size,
                        firsts[rank // tp].ip,
                        ports[rank // tp],
                        all_reduce,
                        self.all_reduce_shms[rank // tp],
                        self.cpu_bind if single_node else "none",
                        pp,
                        (self.ranks[rank + tp].ip, listening[rank]) if pp > 1 and rank + tp < self.world_size else None,
                    )
                )
                for rank, r in enumerate(self.ranks)
            )
        )
        for rank, r in enumerate(self.ranks[: self.num_local]):
            assert self.requests is not None
            r.serving = asyncio.ensure_future(
                _wait_ref(
                    r.actor.serve_ring.remote(
                        str(self.requests.handle()), str(self.responses[rank].handle()), rank, os.getpid()
                    )
                )
            )

    def _group_all_reduce(self, single_node: bool) -> str:
        """The group's all-reduce: as asked on one node; across nodes the shm segment cannot
        reach every rank, so gloo (CPU) or NCCL (CUDA)."""
        if single_node:
            self._make_all_reduce_segments()
            return self.all_reduce_requested
        from aiolm.distributed.communicator import requested_all_reduce

        requested = requested_all_reduce(self.all_reduce_requested)
        if requested in ("shm", "symm_mem"):
            raise ExecutorError(
                f"all_reduce {requested!r} needs every rank on one node; these ranks span "
                f"{len({r.node_id for r in self.ranks})} node(s) "
                f"({self.world_size - self.num_local} reached through Ray); use auto"
            )
        return "nccl" if self.cfg.device.startswith("cuda") else "gloo"

    # -- failures -------------------------------------------------------------------------

    async def _watch_actors(self) -> None:
        """Ray's word (a lifeline or ring loop ended) for every rank, and, for ranks on this
        node, their pids every 0.2 s, which is quicker than Ray's notice on a busy machine."""
        watched = [f for r in self.ranks for f in (r.lifeline, r.serving) if f is not None]
        while not self._closed:
            done, _ = await asyncio.wait(watched, timeout=0.2, return_when=asyncio.FIRST_COMPLETED)
            if done or self._exited() is not None:
                if not self._closed:
                    self._fail(await self._death_reason("a Ray worker actor stopped"))
                return

    def _exited(self) -> str | None:
        gone = [(rank, r, r.poll()) for rank, r in enumerate(self.ranks)]
        gone = sorted((g for g in gone if g[2] is not None), key=lambda g: (g[2] >= 0, g[0]))  # type: ignore[operator]
        if not gone:
            return None
        return "; ".join(
            f"worker {rank} (Ray actor, {r.where()}) " + ("died" if code < 0 else f"stopped with code {code}")
            for rank, r, code in gone
        )

    def _check(self) -> None:
        if self._dead is not None:
            raise ExecutorError(self._dead, self._detail)
        if self._closed or not self.ranks:  # no rings when every rank is remote
            raise ExecutorError("executor is shut down")

    def _remote_call(self, rank: int, method: str, buf: bytes, seq: int) -> asyncio.Future[Any]:
        return asyncio.ensure_future(_wait_ref(getattr(self.ranks[rank].actor, method).remote(buf, seq)))

    async def _remote_answer(self, rank: int, fut: asyncio.Future[Any], timeout: float) -> bytes | None:
        """A remote rank's reply; a dead actor, an error or silence past ``timeout`` fails the executor."""
        try:
            reply, code = await wait_for(asyncio.shield(fut), timeout or None)
        except asyncio.TimeoutError:
            r = self.ranks[rank]
            self._fail(
                f"worker {rank} (Ray actor, {r.where()}) is hung: no answer to a step within "
                f"{timeout:g} s (--step-timeout)"
            )
            r.kill()
            raise ExecutorError(self._dead or "hung") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(await self._death_reason(f"worker {rank} (Ray actor) failed: {type(e).__name__}: {e}"))
            raise ExecutorError(self._dead or str(e)) from e
        if code is not None and code != 0:
            msg = codec.decode(reply) if reply is not None else None
            if isinstance(msg, tuple) and msg and msg[0] == "error":  # any rank's step raised
                self._step_result(msg, rank)  # raises, with the rank's traceback
            self._fail(await self._death_reason(f"worker {rank} (Ray actor) stopped: it lost a peer"))
            raise ExecutorError(self._dead or "stopped")
        return reply

    # -- steps --------------------------------------------------------------------------

    async def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return await self.result(await self.submit(step))

    async def submit(self, step: SchedulerOutput) -> _Step:
        """Hand the step to every rank and return: the rings' readers take steps in ring order,
        the Ray ranks in the order of their sequence numbers (RayWorker.handle), so steps may
        queue behind each other (a pipeline's stages compute at once)."""
        async with self._lock:
            self._check()
            buf = codec.encode_scheduler_output(step)
            seq = self._next_seq()
            answering = self.answering  # the first rank of the last pipeline stage (0 without one)
            remote = {r: self._remote_call(r, "handle", buf, seq) for r in range(self.num_local, self.world_size)}
            local = None
            try:
                if self.num_local:
                    replies = await self._send(buf, [answering] if answering < self.num_local else [])
                    local = replies[0] if replies else None
            except BaseException:
                for fut in remote.values():
                    fut.cancel()
                raise
            return _Step(step.total_num_scheduled_tokens, local, remote)

    async def result(self, handle: Any) -> ModelRunnerOutput:
        step: _Step = handle
        tokens = step.tokens
        limit = self.step_watch.limit(tokens) if self.step_watch is not None else 0.0
        answering = self.answering
        answer: bytes | None = None
        try:
            if step.local is not None:
                answer = await self._recv(answering, step.local, limit, tokens)
            for rank, fut in step.remote.items():
                reply = await self._remote_answer(rank, fut, limit)
                if rank == answering:
                    answer = reply
        finally:
            self.abandon(step)
        result = self._step_result(codec.decode(answer) if answer is not None else None)
        if self.step_watch is not None and result.worker_clock:
            self.step_watch.observe(tokens, result.worker_clock[1] - result.worker_clock[0])
        return result

    def abandon(self, handle: Any) -> None:
        for fut in handle.remote.values():
            fut.cancel()

    def _next_seq(self) -> int:
        """The order in which Ray ranks take messages (steps and RPCs alike); callers hold the lock."""
        seq, self._seq = self._seq, self._seq + 1
        return seq

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        async with self._lock:
            self._check()
            buf = codec.encode_rpc(method, args, kwargs)
            seq = self._next_seq()
            remote = {r: self._remote_call(r, "handle", buf, seq) for r in range(self.num_local, self.world_size)}
            replies: list[bytes | None] = []
            try:
                if self.num_local:
                    owed = await self._send(buf, range(self.num_local))
                    replies += [await self._recv(rank, fut) for rank, fut in enumerate(owed)]
                replies += [await self._remote_answer(rank, fut, 0.0) for rank, fut in remote.items()]
            finally:
                for fut in remote.values():
                    fut.cancel()
            results = []
            for rank, reply in enumerate(replies):
                msg = codec.decode(reply) if reply is not None else ("error", "no answer")
                if msg[0] != "ok":
                    raise ExecutorError(f"rpc {method!r} failed on worker {rank}: {msg[1]}")
                results.append(msg[1])
            return results

    # -- shutdown -------------------------------------------------------------------------

    async def _stop_workers(self, grace: float) -> None:
        """Let the ring loops end (the rings are closed by now), kill every actor, wait until
        Ray reports each dead, and remove the placement group."""
        serving = [r.serving for r in self.ranks if r.serving is not None]
        if serving:
            await asyncio.wait(serving, timeout=grace)
        for r in self.ranks:
            try:
                r.kill()
            except Exception as e:  # already gone, or the cluster is unreachable
                log.debug("killing a Ray worker: %s", e)
        lifelines = [r.lifeline for r in self.ranks if r.lifeline is not None]
        if lifelines:  # a killed actor's pending lifeline fails once Ray has seen it die
            await asyncio.wait(lifelines, timeout=max(grace, 5.0))
        for fut in (*lifelines, *serving):
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: the expected ActorDiedError is not an error here
        if self._pg is not None:
            await remove_placement_group_within(self._pg, max(grace, 10.0), "the placement group")
            self._pg = None


async def remove_placement_group_within(pg: Any, timeout: float, what: str) -> None:
    """Remove ``pg``, waiting at most ``timeout`` (a call to Ray's control store, which may be
    gone: it runs in a daemon thread, so one given up on cannot hold up the process's exit);
    a failure is logged, not raised (a shutdown goes on)."""
    from ray.util.placement_group import remove_placement_group

    try:
        await wait_for(in_daemon_thread(remove_placement_group, pg), timeout)
    except asyncio.TimeoutError:
        log.warning("removing %s took over %g s; left to Ray", what, timeout)
    except Exception as e:
        log.warning("removing %s failed: %s", what, e)


def _forced_remote(world_size: int) -> int:
    text = os.environ.get(REMOTE_RANKS_ENV, "0") or "0"
    try:
        k = int(text)
    except ValueError:
        raise ExecutorError(f"{REMOTE_RANKS_ENV}: {text!r} is not a number of ranks") from None
    if not 0 <= k <= world_size:
        raise ExecutorError(f"{REMOTE_RANKS_ENV}: {k} is not in [0, {world_size}]")
    return k


def _runtime_env() -> dict[str, Any]:
    """The actors' environment: this process's aiolm on the path (the same code where the
    node has the same file system) and the knobs that shape the worker's threads and choices."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    env.setdefault("GOMP_SPINCOUNT", "10000")  # as for worker processes (executor/multiproc.py)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return {"env_vars": env}
