"""Sampler time per decode step over [rows, vocab] float32 logits, no model.

Scenarios (each row's settings cycle through the list of the scenario):
* greedy: every row temperature 0 (the argmax fast path);
* random: temperature 0.8 only;
* top_k: temperature 0.7, top-k 40; top_p: temperature 0.8, top-p 0.95;
* mixed: greedy, top-p + seed, top-k + frequency penalty + logprobs,
  min-p + repetition penalty, logit_bias, min_tokens with a stop id;
* constrained: the mixed rows with allowed_token_ids (1000 ids) on one row in
  six and bad_words_token_ids (a one-token and a two-token word) on another.

Each timed step is ``metadata.advance`` (one new token per row) plus the
sampler call, as a decode step does them; the metadata is built once, outside
the timed region. Prints the median and min over the repeats.

``--threads 1 --clock thread`` times this thread's CPU time only: on a machine
shared with other work that is far steadier than wall time (with more torch
threads the CPU time of the others would be missed).

    python benchmarks/bench_sampler.py [--rows 64] [--vocab 49152] [--repeats 50]
        [--threads N] [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from aiolm.params import SamplingParams
from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator

SCENARIOS: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0.0)],
    "random": [SamplingParams(temperature=0.8)],
    "top_k": [SamplingParams(temperature=0.7, top_k=40)],
    "top_p": [SamplingParams(temperature=0.8, top_p=0.95)],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=50, frequency_penalty=0.5, logprobs=5),
        SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.1),
        SamplingParams(temperature=0.9, logit_bias={17: 3.0, 99: -5.0}),
        SamplingParams(temperature=0.0, min_tokens=1000, max_tokens=2000, stop_token_ids=[2]),
    ],
}
SCENARIOS["constrained"] = [
    *SCENARIOS["mixed"][:4],
    SamplingParams(temperature=0.9, allowed_token_ids=list(range(0, 49152, 49))),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[17], [5, 6]]),
]


def run(name: str, rows: int, vocab: int, repeats: int, clock: Callable[[], float]) -> None:
    kinds = SCENARIOS[name]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (100,), generator=g).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (20,), generator=g).tolist() for _ in range(rows)]
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    m = SamplingMetadata.build(params, outputs, prompts, vocab, "cpu", gens, make_generator(0))
    sampler = Sampler()
    logits = [torch.randn(rows, vocab, generator=g) * 3 for _ in range(4)]
    new = [[int(t)] for t in torch.randint(0, vocab, (rows,), generator=g)]
    times = []
    for i in range(repeats + 3):
        t0 = clock()
        m.advance(new)
        sampler(logits[i % len(logits)], m)
        times.append(clock() - t0)
    ms = sorted(t * 1e3 for t in times[3:])  # the first steps warm caches and load the kernels
    print(f"{name:<11} rows={rows} vocab={vocab}  median={statistics.median(ms):7.2f} ms  min={ms[0]:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    for name in SCENARIOS if args.scenario == "all" else [args.scenario]:
        run(name, args.rows, args.vocab, args.repeats, clock)


if __name__ == "__main__":
    main()
