"""Engine <-> worker step latency over the shared-memory rings, plus codec costs.

The engine side runs in an asyncio loop (uvloop when installed): it encodes a
decode-step SchedulerOutput (64 running requests, one new token each, a few new
blocks), writes it to the broadcast ring, and awaits the worker's
ModelRunnerOutput (64 sampled ids) on the response ring through ``read_async``.
The worker is a separate process started with subprocess, like aiolm's workers.

    python benchmarks/bench_ipc.py                # both modes, 1 worker
    python benchmarks/bench_ipc.py --workers 2    # TP=2: broadcast to 2 readers
    python benchmarks/bench_ipc.py --json
    python benchmarks/bench_ipc.py --compare-codec   # msgspec codec vs the marshal one it replaced

Modes: ``back-to-back`` sends the next step as soon as the reply arrives (the
worker usually catches it while spinning); ``idle`` waits ``--gap-us`` between
steps so both sides have gone to sleep and every step pays both wakeups, which is
what a real engine sees around a forward pass.

``--compare-codec`` times encode + decode of 256-request messages (a prefill step
admitting 256 prompts, a steady-state decode step, the reply with and without
logprobs) with today's codec and with the marshal codec of ``--baseline`` (read from
git, with the dataclass messages of that revision), alternating the two in every
repeat, and prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aiolm.core.step import (  # noqa: E402
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from aiolm.ipc import codec  # noqa: E402
from aiolm.ipc.lifeline import parent_alive  # noqa: E402
from aiolm.ipc.shm_ring import PeerDied, RingClosed, ShmRing  # noqa: E402
from aiolm.params import SamplingParams  # noqa: E402


def decode_step(n: int = 64, step: int = 0) -> SchedulerOutput:
    """A typical decode step: n running requests, 1 token each, every 16th gets a block."""
    ids = [f"cmpl-{i:016x}-0" for i in range(n)]
    cached = CachedRequestData(
        req_ids=ids,
        new_token_ids=[[1000 + i + step] for i in range(n)],
        new_block_ids=[[step * n + i] if i % 16 == step % 16 else [] for i in range(n)],
        num_computed_tokens=[512 + step + i for i in range(n)],
    )
    return SchedulerOutput(
        step=step,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r: 1 for r in ids},
        total_num_scheduled_tokens=n,
        finished_req_ids=set(),
    )


def prefill_step(n: int = 8, prompt_len: int = 512) -> SchedulerOutput:
    """A step admitting n new requests with their full prompts."""
    new = [
        NewRequestData(
            f"cmpl-new-{i}",
            list(range(i, i + prompt_len)),
            [],
            SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128),
            list(range(i * 32, i * 32 + prompt_len // 16)),
            0,
        )
        for i in range(n)
    ]
    return SchedulerOutput(
        step=1,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={r.req_id: prompt_len for r in new},
        total_num_scheduled_tokens=n * prompt_len,
        finished_req_ids=set(),
    )


# ------------------------------------------------------------------- worker


def worker_main(req_name: str, resp_name: str, rank: int, ppid: int) -> None:
    """Echo a ModelRunnerOutput for every SchedulerOutput (rank 0 replies)."""
    req = ShmRing.attach(req_name, rank)
    resp = ShmRing.attach(resp_name, None) if rank == 0 else None
    try:
        while True:
            try:
                buf = req.read(timeout=1.0)
            except TimeoutError:
                if not parent_alive(ppid):
                    return
                continue
            except (RingClosed, PeerDied):
                return
            so = codec.decode_scheduler_output(buf)
            if resp is not None:
                ids = so.scheduled_cached_reqs.req_ids
                out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7 + so.step] for _ in ids])
                resp.write(codec.encode_model_runner_output(out))
    finally:
        req.close()
        if resp is not None:
            resp.close()


# ------------------------------------------------------------------- engine


async def run_steps(
    req: ShmRing,
    resp: ShmRing,
    steps: list[SchedulerOutput],
    gap_s: float,
    startup_s: float = 10.0,
    spin_s: float = 0.0,
) -> list[float]:
    """Round-trip times (seconds) of encode -> ring -> worker -> ring -> decode."""
    times = []
    for so in steps:
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        req.write(codec.encode_scheduler_output(so))
        out = codec.decode_model_runner_output(await resp.read_async(timeout=startup_s, spin_s=spin_s))
        times.append(time.perf_counter() - t0)
        assert out.sampled_token_ids[0][0] == 7 + so.step
    return times


def summarize(times: list[float]) -> dict[str, float]:
    us = sorted(t * 1e6 for t in times)
    return {
        "n": len(us),
        "median_us": statistics.median(us),
        "p90_us": us[int(len(us) * 0.90)],
        "p99_us": us[int(len(us) * 0.99)],
        "min_us": us[0],
    }


def round_trip(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    req = ShmRing.create(args.workers, num_slots=16, slot_size=1 << 20)
    resp = ShmRing.create(1, num_slots=16, slot_size=1 << 20, reader_rank=0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", req.name, resp.name, str(rank), str(os.getpid())], env=env
        )
        for rank in range(args.workers)
    ]
    try:
        try:
            import uvloop

            loop = uvloop.new_event_loop() if not args.no_uvloop else asyncio.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        results = {"loop": type(loop).__module__}
        steps = [decode_step(64, i) for i in range(args.iters + args.warmup)]
        try:
            # The first step also waits for the workers to start (importing torch takes a while).
            loop.run_until_complete(run_steps(req, resp, steps[:1], 0.0, startup_s=300))
            modes = [("back-to-back", 0.0, 0.0), ("idle", args.gap_us * 1e-6, 0.0)]
            if args.spin_us:
                modes.append((f"b2b+spin{args.spin_us:g}us", 0.0, args.spin_us * 1e-6))
            for mode, gap, spin in modes:
                times = loop.run_until_complete(run_steps(req, resp, steps, gap, spin_s=spin))
                results[mode] = summarize(times[args.warmup :])
        finally:
            loop.close()
        return results
    finally:
        req.close()  # workers see RingClosed and exit
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        resp.close()


def codec_costs(iters: int) -> dict[str, dict[str, float]]:
    """Best-of-batches per-call cost (us) of our codec vs plain pickle."""

    reps = max(5, iters // 200)

    def best(fn, *a, n=200) -> float:
        low = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(*a)
            low = min(low, (time.perf_counter() - t0) / n)
        return low * 1e6

    so = decode_step(64, 3)
    runner_output = ModelRunnerOutput(
        req_ids=so.scheduled_cached_reqs.req_ids, sampled_token_ids=[[5] for _ in range(64)]
    )
    out = {}
    for name, obj in (
        ("SchedulerOutput decode x64", so),
        ("SchedulerOutput prefill 8x512", prefill_step()),
        ("ModelRunnerOutput x64", runner_output),
    ):
        enc, pk = codec.encode(obj), pickle.dumps(obj, protocol=5)
        out[name] = {
            "bytes": len(enc),
            "encode_us": best(codec.encode, obj),
            "decode_us": best(codec.decode, enc),
            "pickle_bytes": len(pk),
            "pickle_dumps_us": best(pickle.dumps, obj, 5),
            "pickle_loads_us": best(pickle.loads, pk),
        }
    rpc_str = codec.encode_rpc("load_model", ("x",), {"dtype": "float32"})
    rpc_fn = codec.encode_rpc(lambda worker, k: worker.rank * k, (3,))
    out["rpc by name"] = {
        "bytes": len(rpc_str),
        "encode_us": best(codec.encode_rpc, "load_model", ("x",)),
        "decode_us": best(codec.decode, rpc_str),
    }
    out["rpc lambda (cloudpickle)"] = {
        "bytes": len(rpc_fn),
        "encode_us": best(codec.encode_rpc, lambda w: w.rank, (), n=20),
        "decode_us": best(codec.decode, rpc_fn, n=20),
    }
    return out


# ------------------------------------------------------------ codec comparison


def load_baseline_codec(rev: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(step messages, codec) modules of ``rev``, read with ``git show`` into private modules."""

    def module(name: str, path: str, replace: tuple[str, str] | None = None) -> types.ModuleType:
        src = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        if replace:
            src = src.replace(*replace)
        mod = types.ModuleType(name)
        sys.modules[name] = mod  # dataclasses resolve their annotations through sys.modules
        exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102 (this repository's own source)
        return mod

    step = module("_baseline_step", "aiolm/core/step.py")
    codec_mod = module(
        "_baseline_codec", "aiolm/ipc/codec.py", ("from aiolm.core.step import", "from _baseline_step import")
    )
    return step, codec_mod


def messages(types_: Any, n: int = 256, seed: int = 0) -> dict[str, Any]:
    """The compared messages, built from ``types_`` (a module holding the step message classes).

    Prompt lengths are drawn log-normally (median 512, 32..4096 tokens): chat prompts with
    a system prompt and some history; each request's blocks cover its prompt in 16-token blocks.
    """
    rng = random.Random(seed)
    lens = [min(4096, max(32, int(rng.lognormvariate(6.24, 0.8)))) for _ in range(n)]
    ids = [f"chatcmpl-{rng.getrandbits(64):016x}-0" for _ in range(n)]
    params = [
        SamplingParams(
            temperature=0.7,
            top_p=0.9,
            max_tokens=512,
            stop=["\nUser:"] if i % 4 == 0 else [],
            logprobs=5 if i % 8 == 0 else None,
            eos_token_ids=(2,),
        )
        for i in range(n)
    ]
    new = []
    blocks = 0
    for rid, length, sp in zip(ids, lens, params):
        prompt = [rng.randrange(32000) for _ in range(length)]
        nb = -(-length // 16)
        new.append(types_.NewRequestData(rid, prompt, [], sp, list(range(blocks, blocks + nb)), 0))
        blocks += nb
    prefill = types_.SchedulerOutput(
        step=1,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=types_.CachedRequestData(),
        num_scheduled_tokens=dict(zip(ids, lens)),
        total_num_scheduled_tokens=sum(lens),
        finished_req_ids=set(),
    )
    cached = types_.CachedRequestData(
        req_ids=ids,
        new_token_ids=[[rng.randrange(32000)] for _ in ids],
        new_block_ids=[[blocks + i] if i % 16 == 0 else [] for i in range(n)],
        num_computed_tokens=[length + 40 for length in lens],
    )
    decode = types_.SchedulerOutput(
        step=41,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=n,
        finished_req_ids=set(),
    )
    sampled = [[rng.randrange(32000)] for _ in ids]
    clock = {"worker_times": [0.0004, 0.021, 0.0012], "worker_clock": [1234.5, 1234.523]}
    reply = types_.ModelRunnerOutput(req_ids=list(ids), sampled_token_ids=sampled, **clock)
    logprobs = {
        rid: types_.LogprobsLists(
            token_ids=[[tok[0]] + [rng.randrange(32000) for _ in range(5)]],
            logprobs=[[-rng.random() * 5 for _ in range(6)]],
            ranks=[1],
        )
        for rid, tok in zip(ids, sampled)
    }
    reply_lp = types_.ModelRunnerOutput(req_ids=list(ids), sampled_token_ids=sampled, logprobs=logprobs, **clock)
    return {
        f"SchedulerOutput prefill {n} new (median 512 tokens)": prefill,
        f"SchedulerOutput decode {n} running": decode,
        f"ModelRunnerOutput {n}": reply,
        f"ModelRunnerOutput {n}, top-5 logprobs each": reply_lp,
    }


def compare_codecs(rev: str, repeats: int) -> dict[str, dict[str, float]]:
    """Median encode + decode seconds per message, baseline codec vs this one, alternating."""
    old_step, old_codec = load_baseline_codec(rev)
    import aiolm.core.step as new_step

    old_msgs, new_msgs = messages(old_step), messages(new_step)

    def once(c: Any, msg: Any, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            c.decode(c.encode(msg))
        return (time.perf_counter() - t0) / n

    results = {}
    for name in new_msgs:
        old, new = old_msgs[name], new_msgs[name]
        assert codec.decode(codec.encode(new)) == new
        assert old_codec.decode(old_codec.encode(old)) == old
        n = max(1, int(0.02 / max(once(codec, new, 1), 1e-6)))  # about 20 ms per timing
        olds, news = [], []
        for _ in range(repeats):
            olds.append(once(old_codec, old, n))
            news.append(once(codec, new, n))
        o, m = statistics.median(olds), statistics.median(news)
        results[name] = {
            "baseline_us": o * 1e6,
            "msgspec_us": m * 1e6,
            "ratio": m / o,
            "baseline_bytes": len(old_codec.encode(old)),
            "msgspec_bytes": len(codec.encode(new)),
        }
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--workers", type=int, default=1, help="broadcast readers (TP size); rank 0 replies")
    ap.add_argument("--gap-us", type=float, default=2000.0, help="pause between steps in idle mode")
    ap.add_argument(
        "--spin-us",
        type=float,
        default=0.0,
        help="also run back-to-back with the engine polling this long before sleeping",
    )
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--compare-codec",
        action="store_true",
        help="only compare the codec with the marshal one of --baseline (no processes)",
    )
    ap.add_argument("--baseline", default="d035e07", help="git revision holding the marshal codec")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    if args.compare_codec:
        res = compare_codecs(args.baseline, args.repeats)
        if args.json:
            print(json.dumps(res, indent=2))
            return
        print(f"encode + decode, median of {args.repeats} (marshal codec of {args.baseline} vs msgspec):")
        for name, r in res.items():
            print(
                f"  {name:48s} {r['baseline_us']:8.1f} us -> {r['msgspec_us']:8.1f} us  x{r['ratio']:.2f}"
                f"   ({r['baseline_bytes']} -> {r['msgspec_bytes']} B)"
            )
        return
    load = os.getloadavg()[0]
    results = {
        "round_trip": round_trip(args),
        "codec": codec_costs(args.iters),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load,
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    rt = results["round_trip"]
    print(
        f"round trip, 64-request decode step, {args.workers} worker(s), loop={rt['loop']}, "
        f"{results['cpus']} CPUs, load average before {results['loadavg_1m_before']:.1f}:"
    )
    for mode, s in rt.items():
        if mode == "loop":
            continue
        print(
            f"  {mode:16s} median {s['median_us']:7.1f} us  p90 {s['p90_us']:7.1f}  "
            f"p99 {s['p99_us']:7.1f}  min {s['min_us']:6.1f}  (n={s['n']})"
        )
    print("codec (best-of, per call):")
    for name, c in results["codec"].items():
        line = f"  {name:30s} {c['bytes']:6d} B  enc {c['encode_us']:6.1f} us  dec {c['decode_us']:6.1f} us"
        if "pickle_dumps_us" in c:
            line += (
                f"   | pickle {c['pickle_bytes']:6d} B  {c['pickle_dumps_us']:6.1f} / {c['pickle_loads_us']:6.1f} us"
            )
        print(line)


if __name__ == "__main__":
    main()
