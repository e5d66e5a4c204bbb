"""One-row decode steps of the embedded model with its layers as one C++ call and one call
per layer, timed in turns in one process (the box's drift falls on both).

    python benchmarks/bench_decode_stack.py [--rounds 8] [--steps 16] [--context 128] [--threads 2]

Each round runs ``--steps`` decode steps of one sequence with ``model.fused_stack`` (the
stage's layers in ``aiolm::decode_layers``) and as many with it off (a ``decode_layer``
call per layer), alternating which goes first; prints the medians of the rounds' mean step
times, LM head included. Both give the same bits (tests/kernels/test_decode_layer.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from aiolm.checkpoint.source import resolve_model  # noqa: E402
from aiolm.model.registry import build_model  # noqa: E402
from paged import PagedHarness  # noqa: E402  (the tests' paged-cache driver)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = build_model(resolve_model(None))
    stack = model.fused_stack
    if stack is None:
        sys.exit("the model's layers have no one-call step here (no C++ kernels, or not the GGUF blocks)")
    h = PagedHarness(model, num_blocks=4 + (a.context + a.rounds * 2 * a.steps) // 16)
    h.step({0: list(range(100, 100 + a.context))})
    times: dict[str, list[float]] = {"one call": [], "per layer": []}
    token = 5
    for r in range(a.rounds):
        order = ["one call", "per layer"] if r % 2 == 0 else ["per layer", "one call"]
        for how in order:
            model.fused_stack = stack if how == "one call" else None
            t0 = time.perf_counter()
            for _ in range(a.steps):
                h.step({0: [token]})
                token += 1
            times[how].append((time.perf_counter() - t0) / a.steps * 1e3)
    model.fused_stack = stack
    med = {k: statistics.median(v) for k, v in times.items()}
    for how, ms in med.items():
        print(f"{how}: {ms:.3f} ms per step (median of {a.rounds} rounds of {a.steps})")
    print(f"one call / per layer: {med['one call'] / med['per layer']:.3f}")


if __name__ == "__main__":
    main()
