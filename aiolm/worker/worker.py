"""Worker process main: one per tensor-parallel rank, started as its own program.

``python -m aiolm.worker --rank R ...`` attaches to the engine's request ring (as
reader R) and to its own response ring (as writer), builds the model runner,
reports ready with its KV capacity, then executes whatever arrives until the
engine closes the ring or dies. It never forks and never imports user code.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import posix_ipc

from aiolm.config import RunnerConfig
from aiolm.distributed.stages import answering_rank
from aiolm.ipc import codec, segment
from aiolm.ipc.heartbeat import Heartbeat
from aiolm.ipc.lifeline import exit_on_signals, parent_alive
from aiolm.ipc.shm_ring import PeerDied, RingClosed, RingHandle, ShmRing

log = logging.getLogger("aiolm.worker")

# Test-only fault injection: with AIOLM_TEST_FAULT=<path>, rank 0 raises inside the
# next step once that file exists (and removes it, so the fault fires once), which
# lets the reliability tests drive the step-error path on the real model.
FAULT_ENV = "AIOLM_TEST_FAULT"


class InjectedFault(RuntimeError):
    """Raised by the test-only fault hook."""


def _injected_fault(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    raise InjectedFault(f"{FAULT_ENV}: fault injected by {path}")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aiolm.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--request-ring", required=True)
    p.add_argument("--response-ring", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--dist-port", type=int, default=0, help="loopback port for the rank rendezvous")
    p.add_argument("--all-reduce", default="auto", help="distributed/communicator.py CHOICES")
    p.add_argument("--all-reduce-shm", default=None, help="the engine's all-reduce segment (CPU)")
    p.add_argument("--heartbeat", default=None, help="the engine's heartbeat segment (ipc/heartbeat.py)")
    p.add_argument("--cpu-bind", default="auto", help="auto, none, or cpu lists per rank: 0-3;4-7")
    p.add_argument("--pipeline-size", type=int, default=1, help="pipeline stages; world_size counts all their ranks")
    p.add_argument("--stage-recv", default=None, help="the ring from the previous pipeline stage")
    p.add_argument("--stage-send", default=None, help="the ring to the next pipeline stage")
    p.add_argument("--config", required=True, help="base64 pickle of RunnerConfig")
    return p.parse_args(argv)


def _engine_gave_up() -> int:
    """The engine's segments were gone before this worker attached them: the engine stopped
    its start (a server told to stop while it loaded) and removed them. Nothing to serve."""
    log.info("the engine stopped its start before this worker attached to it; exiting")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    level = os.environ.get("AIOLM_LOG_LEVEL", "WARNING").upper()  # "info" crashed the process
    logging.basicConfig(
        level=level if isinstance(logging.getLevelName(level), int) else "WARNING",
        format=f"%(asctime)s worker{args.rank} %(levelname)s %(message)s",
    )
    exit_on_signals()
    # Ctrl-C in a terminal reaches the whole foreground process group; the engine decides
    # what an interrupt means (stop an answer, shut down) and stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("aiolm.kernels").setLevel(logging.INFO)  # the first-use build's progress
    handles = [RingHandle.parse(args.request_ring), RingHandle.parse(args.response_ring)]
    try:
        requests = ShmRing.attach(handles[0], reader_rank=args.rank)
        responses = ShmRing.attach(handles[1], reader_rank=None)
        # Beating from the start: loading the model is progress too.
        beat = Heartbeat(args.heartbeat, args.rank) if args.heartbeat else None
    except posix_ipc.ExistentialError:
        return _engine_gave_up()  # what it attached goes with the process
    link = None
    try:
        link = _stage_link(args, handles)
        return _serve(args, requests, responses, beat, link)
    finally:
        if link is not None:
            link.close()
        if not parent_alive(args.parent_pid):
            for h in handles:  # the engine was killed: nobody else will unlink its rings
                h.unlink()
            for name in (args.all_reduce_shm, args.heartbeat):
                if name:
                    segment.unlink(name)
        requests.close()
        responses.close()


def _stage_link(args: argparse.Namespace, handles: list[RingHandle]) -> Any:
    """This rank's ends of the rings to its neighbouring pipeline stages (None without a
    pipeline); their handles join ``handles``, which a worker outliving its engine unlinks."""
    if args.pipeline_size == 1:
        return None
    from aiolm.distributed.stage_link import StageLink

    recv = send = None
    if args.stage_recv:
        handles.append(RingHandle.parse(args.stage_recv))
        recv = ShmRing.attach(handles[-1], reader_rank=0)
    if args.stage_send:
        handles.append(RingHandle.parse(args.stage_send))
        send = ShmRing.attach(handles[-1], reader_rank=None)
    return StageLink(recv, send)


def _watch_parent_while(parent_pid: int, busy: threading.Event) -> None:
    """While ``busy`` (the model loads, the kernels may compile for minutes) nothing reads the
    ring, whose timeouts are where the worker otherwise notices its engine is gone: poll here,
    and end this process as a SIGTERM does (its ``finally`` unlinks the rings) if it dies."""
    while busy.is_set():
        if not parent_alive(parent_pid):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
            _kill_children()  # a kernel build's compilers, which the exit would wait for
            return
        time.sleep(0.5)


def _kill_children() -> None:
    """SIGKILL this process's child processes (Linux: /proc/self/task/*/children)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _serve(args: argparse.Namespace, requests: ShmRing, responses: ShmRing, beat: Heartbeat | None, link: Any) -> int:
    loading = threading.Event()
    loading.set()
    threading.Thread(target=_watch_parent_while, args=(args.parent_pid, loading), daemon=True).start()
    try:
        runner, info = build_runner(
            RunnerConfig.decode(args.config),
            args.rank,
            args.world_size,
            port=args.dist_port,
            all_reduce=args.all_reduce,
            shm_name=args.all_reduce_shm,
            cpu_bind=args.cpu_bind,
            pipeline_size=args.pipeline_size,
            link=link,
        )
    except BaseException as e:
        loading.clear()
        responses.write(codec.encode(("error", f"{type(e).__name__}: {e}", traceback.format_exc())))
        return 1
    loading.clear()
    responses.write(codec.encode(("ready", info)))
    return serve_ring(
        runner,
        args.rank,
        requests,
        responses,
        lambda: parent_alive(args.parent_pid),
        beat.step_done if beat is not None else None,
        answers_steps=args.rank == answering_rank(args.world_size, args.pipeline_size),
    )


def build_runner(
    cfg: RunnerConfig,
    rank: int,
    world_size: int,
    *,
    port: int,
    all_reduce: str = "auto",
    shm_name: str | None = None,
    cpu_bind: str = "auto",
    host: str = "127.0.0.1",
    pipeline_size: int = 1,
    link: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """This rank's tensor-parallel group, pipeline stage and model runner, and its ready
    message (KV capacity, the all-reduce it runs). Ranks are numbered stage by stage:
    rank r is rank r % T of stage r // T, T = world_size // pipeline_size, and ``port`` and
    ``shm_name`` are its stage's. Shared by worker processes and Ray actors
    (executor/ray_worker.py); ``link``: the rings to its neighbouring stages."""
    from aiolm.distributed.parallel_state import PipelineStage, set_pp_stage, set_tp_group
    from aiolm.platforms import get_platform
    from aiolm.worker.model_runner import ModelRunner

    tp_size = world_size // pipeline_size
    platform = get_platform(cfg.device)
    platform.worker_device(cfg.device, rank + cfg.device_offset)  # current before the group forms
    platform.pin_worker(rank, world_size, cpu_bind)
    group, name = platform.make_tp_group(
        rank % tp_size, tp_size, port, all_reduce=all_reduce, shm_name=shm_name, host=host
    )
    set_tp_group(group)
    set_pp_stage(PipelineStage(rank // tp_size, pipeline_size))
    runner = ModelRunner(cfg, link)
    platform.tune_worker_process()
    return runner, dict(runner.kv_cache_info(), all_reduce=name)


def serve_ring(
    runner: Any,
    rank: int,
    requests: ShmRing,
    responses: ShmRing,
    engine_alive: Callable[[], bool],
    step_done: Callable[[], None] | None = None,
    answers_steps: bool | None = None,
) -> int:
    """Execute whatever arrives on the request ring until the engine closes it or dies;
    the exit status. ``step_done`` is called after each step this rank finished."""
    handler = StepHandler(runner, rank, step_done, answers_steps)
    try:
        while True:
            try:
                buf = requests.read(timeout=1.0)
            except TimeoutError:
                if not engine_alive():
                    return 0
                continue
            except (RingClosed, PeerDied):  # closed by the engine, or the engine is gone
                return 0
            reply, code = handler.handle(buf)
            if reply is not None:
                responses.write(reply)
            if code is not None:
                return code
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()


class StepHandler:
    """One rank's answer to one message from the engine, whatever carried it (a ring or a
    Ray call): a step (only one rank answers it: ``answers_steps``, by default rank 0), an
    RPC, or shutdown."""

    def __init__(
        self, runner: Any, rank: int, step_done: Callable[[], None] | None = None, answers_steps: bool | None = None
    ) -> None:
        self.runner = runner
        self.rank = rank
        self.answers_steps = rank == 0 if answers_steps is None else answers_steps
        self.step_done = step_done
        self.steps = 0
        self.fault_path = os.environ.get(FAULT_ENV) if rank == 0 else None

    def handle(self, buf: bytes | bytearray | memoryview) -> tuple[bytes | None, int | None]:
        """(the encoded reply or None, the exit status once this rank must stop or None)."""
        from aiolm.core.step import SchedulerOutput
        from aiolm.worker.model_runner import call_on_runner

        received = time.perf_counter()
        msg = codec.decode(buf)
        if isinstance(msg, SchedulerOutput):
            self.steps += 1
            try:
                if self.fault_path:
                    _injected_fault(self.fault_path)
                out = self.runner.execute(msg)
            except (PeerDied, RingClosed, TimeoutError) as e:  # a peer (tensor-parallel or pipeline) is gone or stuck
                log.error("rank %d stops: %s", self.rank, e)
                return None, 1
            except Exception as e:
                # The persistent batch may be half-updated: report the cause with its
                # traceback (the engine logs it and replaces this worker set), then exit.
                tb = traceback.format_exc()
                log.error("step %d failed:\n%s", self.steps, tb)
                return codec.encode(("error", f"{type(e).__name__}: {e}", tb)), 1
            if self.step_done is not None:
                self.step_done()
            if not self.answers_steps:
                return None, None
            assert out is not None, "the answering rank runs the last pipeline stage"
            out.worker_clock = [received, time.perf_counter()]
            return codec.encode_model_runner_output(out), None
        if isinstance(msg, codec.RpcCall):
            try:
                result = call_on_runner(self.runner, msg.method, msg.args, msg.kwargs)
                return codec.encode(("ok", result)), None
            except Exception as e:
                return codec.encode(("error", f"{type(e).__name__}: {e}", traceback.format_exc())), None
        if msg == codec.SHUTDOWN:
            return None, 0
        return None, None
