"""The Ray executor on a real multi-node Ray cluster: three raylets on this machine
(``ray.cluster_utils.Cluster``), one CPU each, so ranks that need a CPU each must sit on
different nodes, which Ray's own node ids prove.

1. ``--tensor-parallel-size 3 --ray-placement strict-spread``: one rank per node (the
   head's through the shm rings, the others through Ray calls; gloo all-reduce across
   nodes): greedy tokens equal the local executor's.
2. ``--pipeline-parallel-size 2``: the two stages on two nodes, linked over TCP: the same
   tokens, and the stages' own traces show them computing at once; then a worker node is
   removed (its raylet and the stage on it die) while streams decode: the engine replaces
   the worker set on the nodes left, and every stream ends with the fault-free tokens.
3. ``--data-parallel-size 2 --data-parallel-backend ray`` on the two nodes left: one replica
   process on each (a Ray actor holds it; its worker is a process on that node), the same
   tokens.

Then no Ray process of the cluster is left, and no shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time

import pytest

from aiolm.ipc.wakeup import pid_alive

ray = pytest.importorskip("ray")

from engine_harness import RAY_ARGS, RAY_MAX_NEW, RAY_PROMPTS, greedy_streams, our_segments, overlap_s, running  # noqa: E402
from test_ray_executor import _processes_mentioning  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ARGS = RAY_ARGS
PROMPTS = RAY_PROMPTS
MAX_NEW = RAY_MAX_NEW


def _greedy(engine, started: asyncio.Event | None = None):
    return greedy_streams(engine, PROMPTS, MAX_NEW, started, after=4)


@pytest.fixture(scope="module")
def cluster():
    """Head and two worker nodes of one CPU each, in a short private temp dir (Ray's socket
    paths must stay short); yields (cluster, temp dir), and stops it all afterwards."""
    from ray.cluster_utils import Cluster

    from aiolm.executor import ray_cluster

    ray_cluster.shutdown()  # an earlier test's private cluster, if any
    tmp = tempfile.mkdtemp(prefix="aiolm-rc-", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    node = dict(num_cpus=1, object_store_memory=80 << 20)
    c = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    try:
        workers = [c.add_node(**node) for _ in range(2)]
        c.wait_for_nodes()
        yield c, workers, tmp
    finally:
        ray_cluster.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        deadline = time.monotonic() + 20
        while _processes_mentioning(tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _processes_mentioning(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes left: {left}"


@contextlib.contextmanager
def _serving(cluster, **over):
    """A started engine (replicas, with ``data_parallel_size``) on the cluster and its loop;
    shut down afterwards, leaving no shared memory."""
    from aiolm.config import EngineArgs
    from aiolm.engine.data_parallel import create_engine

    c, _, _ = cluster
    before = our_segments()
    engine = create_engine(EngineArgs(ray_address=c.address, **{"executor": "ray", **ARGS, **over}))
    with running(engine, stop_timeout=60) as started:
        yield started
    assert our_segments() == before


def test_tp3_one_rank_per_node(cluster, ray_reference):
    with _serving(cluster, tensor_parallel_size=3, ray_placement="strict-spread") as (lt, engine):
        ex = engine.executor
        assert len({r.node_id for r in ex.ranks}) == 3, [r.node_id for r in ex.ranks]
        assert ex.all_reduce == "gloo"  # the group spans nodes
        assert lt.run(_greedy(engine), timeout=300) == ray_reference


def test_pp2_stages_on_two_nodes_and_a_lost_node(cluster, ray_reference):
    c, workers, _ = cluster
    with _serving(cluster, pipeline_parallel_size=2) as (lt, engine):
        ex = engine.executor
        stages = [r.node_id for r in ex.ranks]
        assert len(set(stages)) == 2, stages
        assert lt.run(_greedy(engine), timeout=300) == ray_reference
        # two steps in flight through Ray calls: the stages computed at once
        first, last = lt.run(ex.collective_rpc("stage_trace"), timeout=30)
        assert overlap_s(first, last) > 0, "the two stages never computed at the same time"

        # Remove a worker node that holds a stage: its raylet and that stage's actor die.
        ids = {w.node_id: w for w in workers}
        victim = next(ids[n] for n in stages if n in ids)
        started = asyncio.Event()

        async def remove_when_started() -> None:
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.to_thread(c.remove_node, victim)

        async def through_loss() -> list[list[int]]:
            tokens, _ = await asyncio.gather(_greedy(engine, started), remove_when_started())
            return tokens

        assert lt.run(through_loss(), timeout=300) == ray_reference
        now = [r.node_id for r in engine.executor.ranks]
        assert engine.executor is not ex and victim.node_id not in now and len(set(now)) == 2


def test_dp2_one_replica_per_node(cluster, ray_reference):
    """Two replica processes as Ray actors (--data-parallel-backend ray), each with one
    worker process on its node: a bundle of one CPU each, so on one-CPU nodes they must
    land apart; both serve."""
    over = dict(data_parallel_size=2, data_parallel_backend="ray", executor="mp")
    with _serving(cluster, **over) as (lt, engine):
        nodes = [r.launcher.node_id for r in engine.replicas]
        assert len(nodes) == 2 and len(set(nodes)) == 2 and None not in nodes, nodes
        assert lt.run(_greedy(engine), timeout=300) == ray_reference
        assert min(engine.router.stats.routed) >= 1, engine.router.stats  # both served
        pids = [r.status["pid"] for r in engine.replicas]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), pids  # the replica processes ended with the engine
