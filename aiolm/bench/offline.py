"""Offline throughput and latency benchmarks on the engine in this process."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from aiolm.bench.workload import Item, existing_file, jsonl_workload, parse_range, random_workload
from aiolm.config import EngineArgs, int_in
from aiolm.engine.core import StepTimes
from aiolm.params import OutputKind, SamplingParams


async def _run_items(engine: Any, items: list[Item]) -> float:
    async def one(i: int, it: Item) -> None:
        p = SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
        async for _ in engine.generate({"prompt_token_ids": it.prompt_token_ids}, p):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
    return time.perf_counter() - t0


async def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from aiolm.engine.async_engine import AsyncEngine

    items = (
        jsonl_workload(args.dataset)
        if args.dataset
        else random_workload(args.num_requests, args.prompt_len, args.output_len, args.seed)
    )
    out_tokens = sum(it.max_tokens for it in items)
    in_tokens = sum(len(it.prompt_token_ids) for it in items)
    async with AsyncEngine(EngineArgs.from_namespace(args)) as engine:
        await _run_items(engine, items[: min(4, len(items))])  # warm-up
        engine.scheduler.reset_prefix_cache()
        engine.core.times = StepTimes()
        times = []
        for _ in range(args.repeats):
            times.append(await _run_items(engine, items))
            engine.scheduler.reset_prefix_cache()
        costs = engine.core.times.summary()
        spec = _spec_stats(engine)
    med = statistics.median(times)
    return {
        "benchmark": "throughput",
        "requests": len(items),
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "times_s": times,
        "median_s": med,
        "output_tok_s": out_tokens / med,
        "total_tok_s": (in_tokens + out_tokens) / med,
        "requests_s": len(items) / med,
        "step_costs_ms": costs,
        **spec,
    }


async def latency(args: argparse.Namespace) -> dict[str, Any]:
    from aiolm.engine.async_engine import AsyncEngine

    items = random_workload(
        args.batch_size, (args.input_len, args.input_len), (args.output_len_fixed, args.output_len_fixed), args.seed
    )
    async with AsyncEngine(EngineArgs.from_namespace(args)) as engine:
        await _run_items(engine, items)  # warm-up
        engine.core.times = StepTimes()
        times = []
        for _ in range(args.repeats):
            engine.scheduler.reset_prefix_cache()
            times.append(await _run_items(engine, items))
        costs = engine.core.times.summary()
        spec = _spec_stats(engine)
    times.sort()

    def pct(p: float) -> float:
        return times[min(len(times) - 1, int(p / 100 * len(times)))]

    return {
        "benchmark": "latency",
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len_fixed,
        "times_s": times,
        "mean_s": statistics.fmean(times),
        "p50_s": pct(50),
        "p90_s": pct(90),
        "p99_s": pct(99),
        "decode_tok_s": args.batch_size * args.output_len_fixed / statistics.median(times),
        "step_costs_ms": costs,
        **spec,
    }


def _spec_stats(engine: Any) -> dict[str, Any]:
    """Speculative decoding's counters (warm-up included), when it is on."""
    st = engine.spec_decode_stats
    if st is None:
        return {}
    return {
        "spec_decode": {
            "drafts": st.num_drafts,
            "draft_tokens": st.num_draft_tokens,
            "accepted_tokens": st.num_accepted_tokens,
            "acceptance_rate": st.acceptance_rate,
            "accepted_per_position": st.accepted_per_position,
            "drafted_per_position": st.drafted_per_position,
        }
    }


def add_args(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("throughput", help="offline: N seeded random requests, output tokens/s")
    t.add_argument("--num-requests", type=int_in(1), default=64, help="requests per run")
    t.add_argument("--prompt-len", type=parse_range, default="64-256", help="range lo-hi of prompt tokens")
    t.add_argument("--output-len", type=parse_range, default="32-128", help="range lo-hi of output tokens")
    t.add_argument("--dataset", type=existing_file, help="JSONL of {prompt_token_ids, max_tokens} instead of random")
    t.add_argument("--repeats", type=int_in(1), default=3, help="runs; the median is reported")
    t.add_argument("--bench-seed", dest="seed", type=int, default=0)
    t.add_argument("--json", action="store_true")
    EngineArgs.add_cli_args(t, skip=("seed",))
    t.set_defaults(bench_fn=throughput)
    lat = sub.add_parser("latency", help="a fixed batch of fixed lengths, repeated")
    lat.add_argument("--batch-size", type=int_in(1), default=1, help="requests decoded together")
    lat.add_argument("--input-len", type=int_in(1), default=128, help="prompt tokens of each")
    lat.add_argument("--output-len", dest="output_len_fixed", type=int_in(1), default=128, help="tokens each generates")
    lat.add_argument("--repeats", type=int_in(1), default=5, help="runs")
    lat.add_argument("--bench-seed", dest="seed", type=int, default=1)
    lat.add_argument("--json", action="store_true")
    EngineArgs.add_cli_args(lat, skip=("seed",))
    lat.set_defaults(bench_fn=latency)


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = asyncio.run(args.bench_fn(args))
    print(json.dumps(result, indent=None if args.json else 2))
    return result
