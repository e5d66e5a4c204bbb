"""Output processing CPU time per decode step, with and without the engine's metrics.

64 streaming requests (cumulative output, no stop strings) each get one token per step
through ``OutputProcessor.process``, on the embedded model's real tokenizer; a step is
timed from the core's outputs to every request's state updated (consumers are not run).
Rounds alternate between a processor with ``EngineMetrics`` and one without, so both see
the same machine load; medians of the per-step times are printed. On a loaded machine the
difference drowns in noise, so the metrics' own call per step (``step_outputs`` with one
latency per request) is also timed alone.

    python benchmarks/bench_output.py [--steps 400] [--rounds 5] [--requests 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from aiolm.core.outputs import EngineCoreOutput  # noqa: E402
from aiolm.engine.output import OutputProcessor  # noqa: E402
from aiolm.metrics import EngineMetrics  # noqa: E402
from aiolm.model.loader import resolve_model  # noqa: E402
from aiolm.params import SamplingParams  # noqa: E402


class _Idle:
    """What the metrics read at scrape time; never scraped here."""

    def num_requests(self) -> tuple[int, int]:
        return 0, 0


def one_round(tokenizer, with_metrics: bool, requests: int, steps: int, rng: random.Random) -> list[float]:
    metrics = None
    if with_metrics:
        metrics = EngineMetrics(_Idle())
        metrics.configure("bench", 4096)
    proc = OutputProcessor(tokenizer, lambda ids: None, metrics=metrics)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prompt = tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    for i in range(requests):
        proc.register(f"r{i}", None, prompt, params, [f"r{i}@0"])
    vocab = [t for t in range(1000, 20000)]
    times = []
    now = time.monotonic()
    for _ in range(steps):
        outs = [EngineCoreOutput(f"r{i}@0", [rng.choice(vocab)]) for i in range(requests)]
        now += 0.02
        t0 = time.perf_counter()
        proc.process(outs, now)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args()
    tokenizer = resolve_model(None).load_tokenizer()
    rng = random.Random(0)
    medians: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            medians[on].append(statistics.median(one_round(tokenizer, on, args.requests, args.steps, rng)) * 1e6)
    for on in (False, True):
        ms = medians[on]
        print(f"metrics {'on ' if on else 'off'}: per-step median {statistics.median(ms):7.1f} us "
              f"(round medians {', '.join(f'{m:.1f}' for m in ms)})")
    m = EngineMetrics(_Idle())
    m.configure("bench", 4096)
    gaps = [rng.uniform(0.005, 0.2) for _ in range(args.requests)]
    runs = timeit.repeat(lambda: m.step_outputs(0, args.requests, gaps), number=2000, repeat=7)
    print(f"step_outputs alone ({args.requests} latencies): {min(runs) / 2000 * 1e6:.1f} us per step (best of 7)")


if __name__ == "__main__":
    main()
