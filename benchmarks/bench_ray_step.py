"""Per-step transport cost of the Ray executor's two paths, for a 64-request decode step.

Both paths carry the same messages as the engine (aiolm/executor/ray.py): the
encoded SchedulerOutput of a decode step (64 running requests, one token each) out,
the encoded ModelRunnerOutput (64 sampled ids) back; the worker only decodes and
answers (no model), so the time measured is the transport's:

- ``shm``: the shared-memory rings, to a worker process (bench_ipc.py's echo
  worker), as for ranks on the engine's node;
- ``ray``: a Ray actor call with the encoded step as its argument and the encoded
  answer as its result, awaited on the engine's uvloop through the ObjectRef's
  future, as for ranks on another node (here the actor is on this node, so no
  network time is included: this is Ray's own overhead).

Each step is preceded by a ``--gap-us`` pause, so both sides have gone idle as
around a real forward pass. The modes run in interleaved rounds (round-robin) and
the medians of all steps are reported.

    python benchmarks/bench_ray_step.py                # 5 rounds x 300 steps per mode
    python benchmarks/bench_ray_step.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_ipc import decode_step  # noqa: E402

from aiolm.core.step import ModelRunnerOutput  # noqa: E402
from aiolm.ipc import codec  # noqa: E402
from aiolm.ipc.shm_ring import ShmRing  # noqa: E402


class EchoRank:
    """A Ray actor answering a step the way RayWorker.handle does, without a model."""

    def handle(self, buf: bytes) -> tuple[bytes | None, int | None]:
        so = codec.decode_scheduler_output(buf)
        ids = so.scheduled_cached_reqs.req_ids
        out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7 + so.step] for _ in ids])
        return codec.encode_model_runner_output(out), None


async def shm_steps(req: ShmRing, resp: ShmRing, steps: list, gap_s: float) -> list[float]:
    times = []
    for so in steps:
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        await req.write_async(codec.encode_scheduler_output(so))
        out = codec.decode_model_runner_output(await resp.read_async(timeout=300, spin_s=100e-6))
        times.append(time.perf_counter() - t0)
        assert out.sampled_token_ids[0][0] == 7 + so.step
    return times


async def ray_steps(actor, steps: list, gap_s: float) -> list[float]:
    times = []
    for so in steps:
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        ref = actor.handle.remote(codec.encode_scheduler_output(so))
        reply, _ = await asyncio.wrap_future(ref.future())
        out = codec.decode_model_runner_output(reply)
        times.append(time.perf_counter() - t0)
        assert out.sampled_token_ids[0][0] == 7 + so.step
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300, help="steps per mode per round")
    ap.add_argument("--gap-us", type=float, default=2000.0, help="idle time before each step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import ray
    import uvloop

    from aiolm.executor import ray_cluster
    from aiolm.executor.ray import _runtime_env

    so = decode_step(64, 0)
    sizes = {
        "scheduler_output_bytes": len(codec.encode_scheduler_output(so)),
        "model_runner_output_bytes": len(EchoRank().handle(codec.encode_scheduler_output(so))[0] or b""),
    }
    ray_cluster.connect(None, 2)
    actor = ray.remote(EchoRank).options(num_cpus=1, runtime_env=_runtime_env()).remote()
    req = ShmRing.create(1, num_slots=8, slot_size=1 << 20)
    resp = ShmRing.create(1, num_slots=4, slot_size=1 << 18, reader_rank=0)
    worker = subprocess.Popen(
        [sys.executable, str(HERE / "bench_ipc.py"), "--worker", req.name, resp.name, "0", str(os.getpid())],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    loop = uvloop.new_event_loop()
    times: dict[str, list[float]] = {"shm": [], "ray": []}
    try:
        gap = args.gap_us * 1e-6
        warm = [decode_step(64, i) for i in range(20)]
        loop.run_until_complete(shm_steps(req, resp, warm, gap))
        loop.run_until_complete(ray_steps(actor, warm, gap))
        for r in range(args.rounds):
            steps = [decode_step(64, i) for i in range(args.steps)]
            order = [("shm", lambda: shm_steps(req, resp, steps, gap)), ("ray", lambda: ray_steps(actor, steps, gap))]
            for name, run in order if r % 2 == 0 else order[::-1]:
                times[name] += loop.run_until_complete(run())
    finally:
        loop.close()
        req.close()
        worker.wait(10)
        resp.close()
        ray.kill(actor)
        ray_cluster.shutdown()
    result = {**sizes, "gap_us": args.gap_us, "rounds": args.rounds, "steps_per_round": args.steps}
    for name, ts in times.items():
        us = sorted(t * 1e6 for t in ts)
        result[name] = {
            "median_us": round(statistics.median(us), 1),
            "p90_us": round(us[int(len(us) * 0.9)], 1),
            "n": len(us),
        }
    result["ray_minus_shm_median_us"] = round(result["ray"]["median_us"] - result["shm"]["median_us"], 1)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"decode step x64: SchedulerOutput {sizes['scheduler_output_bytes']} B, "
        f"ModelRunnerOutput {sizes['model_runner_output_bytes']} B"
    )
    for name in ("shm", "ray"):
        r = result[name]
        print(f"{name:4s} round trip: median {r['median_us']:8.1f} us  p90 {r['p90_us']:8.1f} us  (n={r['n']})")
    print(f"ray - shm (median): {result['ray_minus_shm_median_us']:.1f} us per step")


if __name__ == "__main__":
    main()
