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
import time
import traceback

from aiolm.config import RunnerConfig
from aiolm.ipc import codec, segment
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
    p.add_argument("--cpu-bind", default="auto", help="auto, none, or cpu lists per rank: 0-3;4-7")
    p.add_argument("--config", required=True, help="base64 pickle of RunnerConfig")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("AIOLM_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s worker{args.rank} %(levelname)s %(message)s")
    exit_on_signals()
    # Ctrl-C in a terminal reaches the whole foreground process group; the engine decides
    # what an interrupt means (stop an answer, shut down) and stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("aiolm.kernels").setLevel(logging.INFO)  # the first-use build's progress
    handles = [RingHandle.parse(args.request_ring), RingHandle.parse(args.response_ring)]
    requests = ShmRing.attach(handles[0], reader_rank=args.rank)
    responses = ShmRing.attach(handles[1], reader_rank=None)
    try:
        return _serve(args, requests, responses)
    finally:
        if not parent_alive(args.parent_pid):
            for h in handles:  # the engine was killed: nobody else will unlink its rings
                h.unlink()
            if args.all_reduce_shm:
                segment.unlink(args.all_reduce_shm)
        requests.close()
        responses.close()


def _serve(args: argparse.Namespace, requests: ShmRing, responses: ShmRing) -> int:
    from aiolm.distributed.parallel_state import set_tp_group
    from aiolm.platforms import get_platform
    from aiolm.worker.model_runner import ModelRunner, call_on_runner

    try:
        cfg = RunnerConfig.decode(args.config)
        group, all_reduce = get_platform(cfg.device).make_tp_group(
            args.rank, args.world_size, args.dist_port, all_reduce=args.all_reduce,
            shm_name=args.all_reduce_shm, cpu_bind=args.cpu_bind)
        set_tp_group(group)
        runner = ModelRunner(cfg)
    except BaseException as e:
        responses.write(codec.encode(("error", f"{type(e).__name__}: {e}", traceback.format_exc())))
        return 1
    responses.write(codec.encode(("ready", dict(runner.kv_cache_info(), all_reduce=all_reduce))))
    from aiolm.core.outputs import SchedulerOutput

    steps = 0
    fault_path = os.environ.get(FAULT_ENV) if args.rank == 0 else None
    while True:
        try:
            buf = requests.read(timeout=1.0)
        except TimeoutError:
            if not parent_alive(args.parent_pid):
                return 0
            continue
        except RingClosed:
            return 0
        received = time.perf_counter()
        msg = codec.decode(buf)
        if isinstance(msg, SchedulerOutput):
            steps += 1
            try:
                if fault_path:
                    _injected_fault(fault_path)
                out = runner.execute(msg)
            except (PeerDied, TimeoutError) as e:  # a tensor-parallel peer is gone or stuck
                log.error("rank %d stops: %s", args.rank, e)
                return 1
            except Exception as e:
                # The persistent batch may be half-updated: report the cause with its
                # traceback through the response ring (the engine logs it and replaces
                # this worker set), then exit.
                tb = traceback.format_exc()
                log.error("step %d failed:\n%s", steps, tb)
                responses.write(codec.encode(("error", f"{type(e).__name__}: {e}", tb)))
                return 1
            if args.rank == 0:
                out.worker_clock = [received, time.perf_counter()]
                responses.write(codec.encode_model_runner_output(out))
        elif isinstance(msg, codec.RpcCall):
            try:
                result = call_on_runner(runner, msg.method, msg.args, msg.kwargs)
                responses.write(codec.encode(("ok", result)))
            except Exception as e:
                responses.write(codec.encode(("error", f"{type(e).__name__}: {e}", traceback.format_exc())))
        elif msg == codec.SHUTDOWN:
            return 0
