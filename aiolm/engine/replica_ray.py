"""Data-parallel replicas on a Ray cluster: ``--data-parallel-backend ray``.

One placement group with a bundle per replica (its ranks' CPUs, and GPUs on CUDA),
placed by ``--ray-placement`` (auto spreads replicas over nodes). In each bundle a
``ReplicaHost`` actor starts the replica process on its node (replica.py) and waits
for it; the replica connects back to the front end over the cluster network and runs
its workers as local processes on that node (--executor mp). Killing the actor (or
losing its node) ends the replica: it watches the actor's process as its parent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from typing import Any

from aiolm.engine.errors import EngineDeadError
from aiolm.engine.replica_client import exit_text, replica_command
from aiolm.engine.replica_link import SECRET_ENV
from aiolm.executor.placement import placement_strategy
from aiolm.executor.ray import _ray, _runtime_env, _wait_ref, remove_placement_group_within
from aiolm.timeouts import wait_for

log = logging.getLogger(__name__)

_REMOVE_TIMEOUT_S = 10.0  # a call to Ray's control store: an unreachable one must not hold up the shutdown


class ReplicaHost:
    """The Ray actor that holds one replica process on its node."""

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, connect: str, secret_hex: str, index: int, log_level: str) -> int:
        """Run the replica process to its end; its exit code."""
        proc = subprocess.Popen(
            replica_command(connect, index, os.getpid(), log_level),
            env={**os.environ, SECRET_ENV: secret_hex},
            stdin=subprocess.DEVNULL,
        )
        return proc.wait()


class RayReplicas:
    """The placement group and one launcher per bundle."""

    def __init__(self, size: int, bundle: dict[str, float], placement: str) -> None:
        self.size = size
        self.bundle = bundle
        self.strategy = placement_strategy(placement, size)
        self.pg: Any = None

    async def place(self, timeout: float) -> list[RayLauncher]:
        _ray()  # a clear error where Ray is not installed
        from ray.util.placement_group import placement_group

        self.pg = placement_group([self.bundle] * self.size, strategy=self.strategy)
        try:
            await wait_for(_wait_ref(self.pg.ready()), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(
                f"the Ray cluster did not place {self.size} data-parallel replicas of {self.bundle} "
                f"({self.strategy}) within {timeout:g} s: does it have that many free?"
            ) from None
        return [RayLauncher(self, i) for i in range(self.size)]

    async def remove(self) -> None:
        if self.pg is None:
            return
        await remove_placement_group_within(self.pg, _REMOVE_TIMEOUT_S, "the replicas' placement group")
        self.pg = None


class RayLauncher:
    """Launches replica ``index`` in its bundle through a ReplicaHost actor."""

    def __init__(self, replicas: RayReplicas, index: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = _ray()
        b = replicas.bundle
        self.actor = (
            ray.remote(ReplicaHost)
            .options(
                num_cpus=b["CPU"],
                num_gpus=b.get("GPU", 0),
                max_concurrency=2,  # run() holds one thread for the process's life
                runtime_env=_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(replicas.pg, placement_group_bundle_index=index),
            )
            .remote()
        )
        self.node_id: str | None = None
        self._run: asyncio.Future[Any] | None = None

    def launch(self, connect: str, secret: bytes, index: int, log_level: str) -> None:
        self._run = asyncio.ensure_future(_wait_ref(self.actor.run.remote(connect, secret.hex(), index, log_level)))

    async def locate(self, timeout: float) -> str:
        try:
            node_id: str = await wait_for(_wait_ref(self.actor.node_id.remote()), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"a data-parallel replica's Ray actor did not start within {timeout:g} s") from None
        self.node_id = node_id
        return node_id

    def exited(self) -> str | None:
        if self._run is None or not self._run.done():
            return None
        if self._run.cancelled() or self._run.exception() is not None:
            return f"lost its Ray actor ({self._run.exception() if not self._run.cancelled() else 'cancelled'})"
        return exit_text(int(self._run.result()))

    async def stop(self, grace: float) -> None:
        if self._run is not None:
            await asyncio.wait([self._run], timeout=grace)
        try:
            _ray().kill(self.actor, no_restart=True)
        except Exception as e:  # already gone, or the cluster is unreachable
            log.debug("killing a replica's Ray actor: %s", e)
        if self._run is not None:
            await asyncio.wait([self._run], timeout=5.0)
            if not self._run.done():
                self._run.cancel()
            elif not self._run.cancelled():
                self._run.exception()  # retrieved: the expected ActorDiedError is not an error here

    def where(self) -> str:
        return f"Ray node {self.node_id}" if self.node_id else "a Ray actor"
