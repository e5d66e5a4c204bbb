"""The Ray actor behind one tensor-parallel rank (made a Ray actor by executor/ray.py).

It runs the same code as a worker process (aiolm/worker/worker.py: ``build_runner``,
``serve_ring``, ``StepHandler``); only the transport differs. A rank on the engine's
own node attaches to the engine's shared-memory rings and serves them until they
close (``serve_ring``), exactly like a worker process. A rank on another node gets
each encoded message as the argument of a Ray call (``handle``) and returns its
answer. Every call runs on one dedicated thread, so the model runner, its torch
state and the process group always see the same thread, while the actor's other
threads stay free for ``lifeline`` and ``node_info``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiolm.config import RunnerConfig
from aiolm.ipc.shm_ring import RingHandle, ShmRing
from aiolm.ipc.wakeup import pid_alive

# Ray threads for one actor: a runner call, the lifeline and a spare for node_info; the
# executor adds one per further message it may have in flight (steps, an RPC).
MAX_CONCURRENCY = 3


class RayWorker:
    def __init__(self) -> None:
        self._runner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiolm-rank")
        self._stopped = threading.Event()
        self.runner: Any = None
        self.handler: Any = None
        self.answers_steps = False
        self._turn = threading.Condition()
        self._seq = 0  # the next message to queue (handle)
        self._stage_listener: socket.socket | None = None  # a later pipeline stage's, until linked

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: its node (for placement decisions), address and pid."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def free_port(self) -> int:
        """A TCP port free on this node, for rank 0's torch.distributed rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def listen_for_stage(self) -> int:
        """A later pipeline stage's rank: listen for the link from the stage before (the port)."""
        from aiolm.distributed.stage_link import TcpChannel

        self._stage_listener, port = TcpChannel.listen()
        return port

    def setup(
        self,
        cfg_text: str,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        all_reduce: str,
        shm_name: str | None,
        cpu_bind: str,
        pipeline_size: int = 1,
        send_to: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Join the tensor-parallel group (``host``:``port``: its stage's rendezvous), link to
        the neighbouring pipeline stages (``send_to``: the next stage's listener), and build
        the model runner; the ready info."""
        return self._runner_thread.submit(
            self._setup, cfg_text, rank, world_size, host, port, all_reduce, shm_name, cpu_bind, pipeline_size, send_to
        ).result()

    def _setup(
        self,
        cfg_text: str,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        all_reduce: str,
        shm_name: str | None,
        cpu_bind: str,
        pipeline_size: int,
        send_to: tuple[str, int] | None,
    ) -> dict[str, Any]:
        from aiolm.distributed.stage_link import StageLink, TcpChannel
        from aiolm.distributed.stages import answering_rank
        from aiolm.worker.worker import StepHandler, build_runner

        cfg = RunnerConfig.decode(cfg_text)
        if cfg.device == "cuda":  # Ray makes the actor's one GPU visible as device 0, whatever the rank
            cfg = dataclasses.replace(cfg, device="cuda:0")
        link = None
        if pipeline_size > 1:  # connect first, then accept: every stage's connect lands at once
            send = TcpChannel.connect(*send_to, timeout_s=60.0) if send_to is not None else None
            listener, self._stage_listener = self._stage_listener, None
            recv = TcpChannel.accept(listener, timeout_s=120.0) if listener is not None else None
            link = StageLink(recv, send)
        self.runner, info = build_runner(
            cfg,
            rank,
            world_size,
            port=port,
            all_reduce=all_reduce,
            shm_name=shm_name,
            cpu_bind=cpu_bind,
            host=host,
            pipeline_size=pipeline_size,
            link=link,
        )
        self.answers_steps = rank == answering_rank(world_size, pipeline_size)
        self.handler = StepHandler(self.runner, rank, answers_steps=self.answers_steps)
        return info

    def serve_ring(self, request_ring: str, response_ring: str, rank: int, engine_pid: int) -> int:
        """A rank on the engine's node: serve the shm rings until they close or the engine dies."""
        return self._runner_thread.submit(self._serve_ring, request_ring, response_ring, rank, engine_pid).result()

    def _serve_ring(self, request_ring: str, response_ring: str, rank: int, engine_pid: int) -> int:
        from aiolm.worker.worker import serve_ring

        requests = ShmRing.attach(RingHandle.parse(request_ring), reader_rank=rank)
        responses = ShmRing.attach(RingHandle.parse(response_ring), reader_rank=None)
        try:
            return serve_ring(
                self.runner,
                rank,
                requests,
                responses,
                lambda: pid_alive(engine_pid),
                answers_steps=self.answers_steps,
            )
        finally:
            requests.close()
            responses.close()

    def handle(self, buf: bytes, seq: int) -> tuple[bytes | None, int | None]:
        """A rank on another node: message ``seq`` (0, 1, 2, ... in the engine's order) in,
        (reply, exit status) out. Ray may run an actor's concurrent calls in any order, so each
        waits for its turn before it joins the runner thread's queue, which runs them in turn."""
        with self._turn:
            while not self._turn.wait_for(lambda: self._seq == seq, timeout=1.0):
                if self._stopped.is_set():
                    return None, 0
            done = self._runner_thread.submit(self.handler.handle, buf)
            self._seq += 1
            self._turn.notify_all()
        return done.result()

    def lifeline(self) -> None:
        """Returns only at ``stop``: while it is pending the actor lives, and when the actor
        or its node dies Ray fails it, which is how the engine learns of the death."""
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()
