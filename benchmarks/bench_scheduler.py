"""Scheduler CPU time per step: schedule() + update_from_output(), no model.

Two scenarios:
* decode: 256 requests all decoding (one token each per step);
* mixed: a steady stream of requests with 200-1000-token prompts (a shared
  system prefix, so prefix-cache hits happen), chunked into a 2048-token budget
  next to ongoing decodes, with requests finishing and arriving every step.

The fake model output is built outside the timed region. Also prints the
pickled size of a step's SchedulerOutput (the message that crosses to workers).

    python benchmarks/bench_scheduler.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.core.step import ModelRunnerOutput, SchedulerOutput
from aiolm.params import SamplingParams


def sampled_ids(sched: Scheduler, so: SchedulerOutput) -> list[str]:
    """Requests whose prefill is complete this step (what a model runner samples for)."""
    reqs = sched.requests
    return [rid for rid in so.num_scheduled_tokens if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens]


def fake_output(rids: list[str], rng: random.Random) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[[rng.randrange(1, 32000)] for _ in rids])


def timed_step(sched: Scheduler, rng: random.Random) -> tuple[float, SchedulerOutput]:
    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    runner_output = fake_output(sampled_ids(sched, so), rng)
    t2 = time.perf_counter()
    sched.update_from_output(so, runner_output)
    t3 = time.perf_counter()
    return (t1 - t0) + (t3 - t2), so


def report(name: str, times: list[float]) -> None:
    us = sorted(t * 1e6 for t in times)
    p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
    print(
        f"{name:<34} steps={len(us):5d}  median={statistics.median(us):8.1f} us  p99={p99:8.1f} us  min={us[0]:8.1f} us"
    )


def bench_decode(steps: int, num_reqs: int = 256, prompt_len: int = 128) -> None:
    rng = random.Random(0)
    cfg = SchedulerConfig(
        num_blocks=num_reqs * (prompt_len + steps + 64) // 16 + 1,
        max_num_seqs=num_reqs,
        max_num_batched_tokens=8192,
        max_model_len=prompt_len + steps + 64,
    )
    sched = Scheduler(cfg)
    sp = SamplingParams(max_tokens=steps + 32, ignore_eos=True)
    for i in range(num_reqs):
        sched.add_request(Request(f"d{i}", [rng.randrange(1, 32000) for _ in range(prompt_len)], sp))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()) or sched.num_waiting:
        timed_step(sched, rng)
    times, so = [], None
    for _ in range(steps):
        t, so = timed_step(sched, rng)
        assert len(so.num_scheduled_tokens) == num_reqs
        times.append(t)
    report(f"decode x{num_reqs}", times)
    print(f"{'':34} SchedulerOutput pickled: {len(pickle.dumps(so))} bytes")


def bench_mixed(steps: int, target_running: int = 200) -> None:
    rng = random.Random(1)
    cfg = SchedulerConfig(num_blocks=20000, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096)
    sched = Scheduler(cfg)
    system = [rng.randrange(1, 32000) for _ in range(160)]
    n = 0

    def add(k: int) -> None:
        nonlocal n
        for _ in range(k):
            prompt = system + [rng.randrange(1, 32000) for _ in range(rng.randrange(40, 840))]
            sp = SamplingParams(max_tokens=rng.randrange(20, 300), ignore_eos=True)
            sched.add_request(Request(f"m{n}", prompt, sp))
            n += 1

    add(target_running)
    for _ in range(300):  # warm up into a steady state
        timed_step(sched, rng)
        add(max(0, target_running - sched.get_num_unfinished_requests()))
    times, mixed = [], 0
    for _ in range(steps):
        t, so = timed_step(sched, rng)
        add(max(0, target_running - sched.get_num_unfinished_requests()))
        if so.scheduled_new_reqs or any(v > 1 for v in so.num_scheduled_tokens.values()):
            mixed += 1
        times.append(t)
    report(f"mixed prefill/decode ~{target_running} reqs", times)
    stats = sched.prefix_cache_stats
    print(
        f"{'':34} steps with prefill chunks: {mixed}, prefix hit rate {stats.hit_rate:.2f}, "
        f"kv usage {sched.kv_cache_usage:.2f}"
    )


def calibrate() -> float:
    """Median time of a fixed pure-Python loop, to compare numbers across machines and load."""
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        sum(range(1000))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    print(f"calibration: sum(range(1000)) takes {calibrate():.1f} us here (roughly 5-10 us on an idle modern x86 core)")
    bench_decode(args.steps)
    bench_mixed(args.steps)
    print(f"calibration after: {calibrate():.1f} us")


if __name__ == "__main__":
    main()
