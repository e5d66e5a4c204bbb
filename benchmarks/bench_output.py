"""Output processing CPU time per decode step, with and without the engine's metrics.

64 streaming requests (cumulative output, no stop strings) each get one token per step
through ``OutputProcessor.process``, on the embedded model's real tokenizer; a step is
timed from the core's outputs to every request's state updated (consumers are not run).
Rounds alternate between a processor with ``EngineMetrics`` and one without, so both see
the same machine load; medians of the per-step times are printed. On a loaded machine the
difference drowns in noise, so the metrics' own call per step (``step_outputs`` with one
latency per request) is also timed alone.

``--root`` times another checkout's code (one from before the metrics has only the
processor without them), for before/after runs alternated from the shell.

    python benchmarks/bench_output.py [--steps 300] [--rounds 5] [--requests 64] [--root DIR]
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import sys
import time
import timeit
from pathlib import Path


class _Idle:
    """What the metrics read at scrape time; never scraped here."""

    def num_requests(self) -> tuple[int, int]:
        return 0, 0


def one_round(tokenizer, metrics, requests: int, steps: int, rng: random.Random) -> list[float]:
    from aiolm.core.step import EngineCoreOutput
    from aiolm.engine.output_processor import OutputProcessor
    from aiolm.params import SamplingParams

    proc = OutputProcessor(tokenizer, lambda ids: None, **({"metrics": metrics} if metrics else {}))
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prompt = tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    for i in range(requests):
        proc.register(f"r{i}", None, prompt, params, [f"r{i}@0"])
    times = []
    for _ in range(steps):
        outs = [EngineCoreOutput(f"r{i}@0", [rng.randrange(1000, 20000)]) for i in range(requests)]
        t0 = time.perf_counter()
        proc.process(outs)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="checkout to time")
    args = ap.parse_args()
    sys.path.insert(0, args.root)
    from aiolm.checkpoint.source import resolve_model
    from aiolm.engine.output_processor import OutputProcessor

    with_metrics = "metrics" in inspect.signature(OutputProcessor).parameters
    tokenizer = resolve_model(None).load_tokenizer()
    rng = random.Random(0)
    sides = (False, True) if with_metrics else (False,)
    medians: dict[bool, list[float]] = {on: [] for on in sides}
    for _ in range(args.rounds):
        for on in sides:
            metrics = None
            if on:
                from aiolm.metrics import EngineMetrics

                metrics = EngineMetrics(_Idle())
                metrics.configure("bench", 4096)
            times = one_round(tokenizer, metrics, args.requests, args.steps, rng)
            medians[on].append(statistics.median(times) * 1e6)
    for on, ms in medians.items():
        print(
            f"{args.root}: metrics {'on ' if on else 'off'}: per-step median {statistics.median(ms):7.1f} us "
            f"(round medians {', '.join(f'{m:.1f}' for m in ms)})"
        )
    if with_metrics:
        from aiolm.metrics import EngineMetrics

        m = EngineMetrics(_Idle())
        m.configure("bench", 4096)
        gaps = [rng.uniform(0.005, 0.2) for _ in range(args.requests)]
        runs = timeit.repeat(lambda: m.step_outputs(0, args.requests, gaps), number=2000, repeat=7)
        print(f"step_outputs alone ({args.requests} latencies): {min(runs) / 2000 * 1e6:.1f} us per step (best of 7)")


if __name__ == "__main__":
    main()
