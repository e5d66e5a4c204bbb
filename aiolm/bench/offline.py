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


async def _run_items(engine: Any, items: list[Item]) -> tuple[float, int]:
    """Seconds the items took all at once, and the tokens they generated (fewer than asked
    where --max-model-len cut an answer short)."""

    async def one(it: Item) -> int:
        p = SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
        n = 0
        async for out in engine.generate({"prompt_token_ids": it.prompt_token_ids}, p):
            n = len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    generated = await asyncio.gather(*(one(it) for it in items))
    return time.perf_counter() - t0, sum(generated)


def _check_fits(engine: Any, items: list[Item]) -> None:
    """A prompt the engine cannot take fails the run before it starts, in one line."""
    longest = max(len(it.prompt_token_ids) for it in items)
    if longest >= engine.max_model_len:
        raise ValueError(
            f"the workload has a prompt of {longest} tokens; --max-model-len {engine.max_model_len} "
            "leaves no room to generate (shorten --prompt-len or raise --max-model-len)"
        )


async def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from aiolm.engine.async_engine import AsyncEngine

    items = (
        jsonl_workload(args.dataset)
        if args.dataset
        else random_workload(args.num_requests, args.prompt_len, args.output_len, args.seed)
    )
    asked = sum(it.max_tokens for it in items)
    in_tokens = sum(len(it.prompt_token_ids) for it in items)
    async with AsyncEngine(EngineArgs.from_namespace(args)) as engine:
        _check_fits(engine, items)
        await _run_items(engine, items[: min(4, len(items))])  # warm-up
        engine.scheduler.reset_prefix_cache()
        engine.core.times = StepTimes()
        times = []
        for _ in range(args.repeats):
            took, out_tokens = await _run_items(engine, items)  # the same tokens each run (greedy)
            times.append(took)
            engine.scheduler.reset_prefix_cache()
        costs = engine.core.times.summary()
        spec = _spec_stats(engine)
    med = statistics.median(times)
    return {
        "benchmark": "throughput",
        "requests": len(items),
        "output_tokens": out_tokens,
        "output_tokens_asked": asked,
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
    import numpy as np

    from aiolm.engine.async_engine import AsyncEngine

    items = random_workload(
        args.batch_size, (args.input_len, args.input_len), (args.output_len_fixed, args.output_len_fixed), args.seed
    )
    async with AsyncEngine(EngineArgs.from_namespace(args)) as engine:
        _check_fits(engine, items)
        await _run_items(engine, items)  # warm-up
        engine.core.times = StepTimes()
        times = []
        for _ in range(args.repeats):
            engine.scheduler.reset_prefix_cache()
            took, out_tokens = await _run_items(engine, items)
            times.append(took)
        costs = engine.core.times.summary()
        spec = _spec_stats(engine)
    times.sort()
    p50, p90, p99 = (float(x) for x in np.percentile(times, [50, 90, 99]))  # as vLLM's benchmarks
    return {
        "benchmark": "latency",
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len_fixed,
        "times_s": times,
        "mean_s": statistics.fmean(times),
        "p50_s": p50,
        "p90_s": p90,
        "p99_s": p99,
        "output_tokens": out_tokens,
        "decode_tok_s": out_tokens / statistics.median(times),
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
    t.add_argument("--bench-seed", dest="seed", type=int_in(0), default=0)
    t.add_argument("--json", action="store_true")
    EngineArgs.add_cli_args(t, skip=("seed",))
    t.set_defaults(bench_fn=throughput)
    lat = sub.add_parser("latency", help="a fixed batch of fixed lengths, repeated")
    lat.add_argument("--batch-size", type=int_in(1), default=1, help="requests decoded together")
    lat.add_argument("--input-len", type=int_in(1), default=128, help="prompt tokens of each")
    lat.add_argument("--output-len", dest="output_len_fixed", type=int_in(1), default=128, help="tokens each generates")
    lat.add_argument("--repeats", type=int_in(1), default=5, help="runs")
    lat.add_argument("--bench-seed", dest="seed", type=int_in(0), default=1)
    lat.add_argument("--json", action="store_true")
    EngineArgs.add_cli_args(lat, skip=("seed",))
    lat.set_defaults(bench_fn=latency)


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = asyncio.run(args.bench_fn(args))
    print(json.dumps(result, indent=None if args.json else 2))
    return result
