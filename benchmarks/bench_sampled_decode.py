"""One stream's decode tokens/s on the embedded model when its tokens are drawn, not argmaxed.

A 128-token prompt, 128 new tokens with the given sampling knobs (a JSON object of
SamplingParams fields; a new seed each run), through ``aiolm.LLM``; prints the median of the
runs after a warm-up. It imports aiolm from the checkout it lies in, so two revisions' trees
(``git worktree add``) run it side by side for an A/B:

    python benchmarks/bench_sampled_decode.py '{"temperature": 0.8, "top_p": 0.95}' [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
# and so do the engine's worker processes, which import aiolm afresh
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

PROMPT_LEN = OUTPUT_LEN = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("knobs", help='SamplingParams fields as JSON, e.g. \'{"temperature": 0.7, "top_k": 40}\'')
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    import aiolm
    from aiolm.params import SamplingParams

    assert aiolm.__file__.startswith(str(ROOT)), f"aiolm from {aiolm.__file__}, not this checkout"
    knobs = json.loads(args.knobs)
    llm = aiolm.LLM()
    prompt = {"prompt_token_ids": list(range(1000, 1000 + PROMPT_LEN))}

    def once(seed: int) -> float:
        p = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, seed=seed, **knobs)
        t0 = time.perf_counter()
        out = llm.generate([prompt], p)
        dt = time.perf_counter() - t0
        assert len(out[0].outputs[0].token_ids) == OUTPUT_LEN
        return OUTPUT_LEN / dt

    once(0)  # warm-up: the kernels, the caches
    runs = [once(seed) for seed in range(1, args.runs + 1)]
    print(json.dumps({"knobs": knobs, "tok_s": round(statistics.median(runs), 1), "runs": [round(r, 1) for r in runs]}))


if __name__ == "__main__":
    main()
