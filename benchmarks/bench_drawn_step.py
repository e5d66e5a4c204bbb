"""One drawn decode step's time (1 row, the embedded model, float32), model and sampling only.

From the tree this file lies in: where the model has the one-call step (``sample_step``,
e5ff13a on), the step is ``model.sampled_tokens``; before it, forward, compute_logits and the
Sampler, as the runner ran a drawn step. Each knob setting decodes 130 steps after a
128-token prompt, feeding fixed tokens (so every setting and tree does the same attention
work), and prints the median step in ms of the last 120. Copy it into an older tree
(``git worktree add``) to A/B the two:

    python benchmarks/bench_drawn_step.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's aiolm and its test harness

import torch  # noqa: E402

from aiolm.checkpoint.source import resolve_model  # noqa: E402
from aiolm.model.registry import build_model  # noqa: E402
from aiolm.params import SamplingParams  # noqa: E402
from aiolm.sample.sampler import Sampler, SamplingMetadata, make_generator  # noqa: E402
from paged import PagedHarness  # noqa: E402

KNOBS = {
    "t0.8_p0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t1.0_p0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7_k40": SamplingParams(temperature=0.7, top_k=40),
}


def main() -> None:
    model = build_model(resolve_model(None), torch.float32)
    vocab = model.config.vocab_size
    one_call = hasattr(model, "sample_step")
    out: dict[str, float] = {}
    for name, p in KNOBS.items():
        h = PagedHarness(model, num_blocks=64)
        h.step({0: list(range(1000, 1128))})
        m = SamplingMetadata.build([p], [[]], [[]], vocab, "cpu", [None], make_generator(0))
        sampler = Sampler()
        times = []
        for i in range(130):
            t0 = time.perf_counter()
            if one_call:
                assert h.sampled_tokens({0: [1000 + i]}, m) is not None
            else:
                ids, pos, meta = h._batch({0: [1000 + i]})
                sampler(model.compute_logits(model(ids, pos, h.caches, meta)), m)
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times[10:]) * 1e3, 3)
    print(json.dumps({"tree": str(ROOT), "one_call": one_call, "step_ms": out}))


if __name__ == "__main__":
    main()
