"""Offline throughput: N requests with random prompt and output lengths through aiolm.LLM.

Seeded workload (numpy ``default_rng(0)``): prompt lengths in [64, 256] tokens,
output lengths in [32, 128] tokens, prompt token ids drawn from [100, 40000];
greedy, ``ignore_eos`` so every request produces exactly its output length.
All requests are submitted at once; each repeat is timed from submission to the
last output, after one untimed warm-up request. Reports the median repeat.

    python benchmarks/bench_offline.py [--num-requests 64] [--repeats 3] [--json]
                                       [--json-schema SCHEMA [--json-max-tokens 256]]
                                       [--dtype auto] [--executor mp] [any engine flag]

``--json-schema`` measures what that schema costs on the same prompts. A grammar
and ``ignore_eos`` do not mix (past the document only the stop token is allowed),
so the constrained requests run until their documents end (``max_tokens`` is
only a cap; a run where one hits it is refused, as is one whose text is not JSON).
An untimed constrained pass gives each request's output length, and the plain
requests then run with ``ignore_eos`` to exactly those lengths: both sides
produce the same tokens' worth of work. Each repeat times both, in alternating
order (plain first in odd repeats), in one engine; the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np

from aiolm import LLM, EngineArgs, SamplingParams
from aiolm.engine.core import StepTimes
from aiolm.structured.spec import StructuredOutputs


def workload(num_requests: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(64, 257, size=num_requests)
    output_lens = rng.integers(32, 129, size=num_requests)
    prompts = [rng.integers(100, 40001, size=int(n)).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the random workload")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument(
        "--json-schema", default=None, help="also time the same prompts with this JSON schema (text) on every request"
    )
    p.add_argument("--json-max-tokens", type=int, default=256, help="cap on a constrained request's tokens")
    EngineArgs.add_cli_args(p)
    args = p.parse_args()
    engine_args = EngineArgs.from_namespace(args)

    prompts, output_lens = workload(args.num_requests, args.workload_seed)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]

    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup = time.perf_counter() - t0
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
        constrained = None
        if args.json_schema:
            constrained = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=args.json_max_tokens,
                    structured_outputs=StructuredOutputs("json", args.json_schema),
                )
                for _ in prompts
            ]
            output_lens = _documents(llm.generate(inputs, constrained, use_tqdm=False), args.json_schema)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        llm.engine.core.times = StepTimes()  # the timed repeats' per-step costs only
        times: list[float] = []
        json_times: list[float] = []
        json_rates: list[float] = []  # output tokens/s of each constrained repeat (its own count)
        for r in range(args.repeats):
            runs = [("plain", params, times)] + ([("json", constrained, json_times)] if constrained else [])
            for name, ps, into in runs if r % 2 == 0 else runs[::-1]:
                t = time.perf_counter()
                outs = llm.generate(inputs, ps, use_tqdm=False)
                into.append(time.perf_counter() - t)
                if name == "json":
                    json_rates.append(sum(_documents(outs, args.json_schema)) / into[-1])
                elif [len(o.outputs[0].token_ids) for o in outs] != output_lens:
                    raise SystemExit(f"repeat {r}: output lengths differ from the requested ones")
                if not args.json:
                    print(f"repeat {r + 1}/{args.repeats} {name}: {into[-1]:.2f}s", file=sys.stderr)
        num_blocks = llm.engine.executor.num_blocks
        step_costs = llm.engine.core.times.summary()
    finally:
        llm.close()

    total = statistics.median(times)
    out_tokens = sum(output_lens)
    in_tokens = sum(len(x) for x in prompts)
    result = {
        "num_requests": args.num_requests,
        "repeats": args.repeats,
        "total_time_s": round(total, 4),
        "times_s": [round(t, 4) for t in times],
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_tok_per_s": round(out_tokens / total, 2),
        "total_tok_per_s": round((out_tokens + in_tokens) / total, 2),
        "requests_per_s": round(args.num_requests / total, 3),
        "startup_s": round(startup, 2),
        "kv_blocks": num_blocks,
        "json_schema": args.json_schema,
        "step_costs_ms": step_costs,
        "engine_args": {k: v for k, v in vars(engine_args).items() if v is not None},
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count()},
    }
    if json_times:
        result["json_times_s"] = [round(t, 4) for t in json_times]
        result["json_output_tok_per_s"] = round(statistics.median(json_rates), 2)
        result["json_to_plain"] = round(result["json_output_tok_per_s"] / result["output_tok_per_s"], 3)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"requests:        {args.num_requests} ({in_tokens} prompt tokens, {out_tokens} output tokens)")
        print(f"total time:      {total:.2f} s (median of {args.repeats})")
        print(f"output tokens/s: {result['output_tok_per_s']:.1f}")
        print(f"total tokens/s:  {result['total_tok_per_s']:.1f}")
        print(f"requests/s:      {result['requests_per_s']:.3f}")
        if json_times:
            print(
                f"with the schema: {result['json_output_tok_per_s']:.1f} output tokens/s "
                f"({result['json_to_plain']:.3f} of plain)"
            )


def _documents(outs: list, schema: str) -> list[int]:
    """Each output's token count, once every output is a finished JSON document (valid
    against ``schema`` where jsonschema is installed)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason != "stop":
            raise SystemExit(f"a constrained request ended with {c.finish_reason!r}: raise --json-max-tokens")
        doc = json.loads(c.text)
        if jsonschema is not None:
            jsonschema.validate(doc, json.loads(schema))
    return [len(o.outputs[0].token_ids) for o in outs]


if __name__ == "__main__":
    main()
