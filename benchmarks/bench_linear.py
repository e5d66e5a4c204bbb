"""Where the CPU fast path's thresholds come from: linear layers and whole decode steps.

    python benchmarks/bench_linear.py [--threads 2]

1. SmolLM2-135M's linear shapes at several batch sizes: F.linear (MKL) against
   oneDNN with the weight packed once (model/layers/cpu_linear.py) and against
   the GGUF file's own blocks (aiolm::gguf_linear). Weights stay in cache here,
   which flatters every method.
2. One decode step of the real model over a paged KV cache (128-token contexts)
   at batch sizes 1-32, with the GGUF-block path off and on: this, not (1), sets
   gguf_blocks.MAX_ROWS, since in a real step the weights come from memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402


def timed(f, n: int) -> float:
    for _ in range(3):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from paged import PagedHarness

    from aiolm.model import gguf_blocks
    from aiolm.model.layers.cpu_linear import packed_linear
    from aiolm.model.loader import resolve_model
    from aiolm.model.registry import build_model

    model = build_model(resolve_model(None))
    layer = model.layers[0]
    print("| layer | rows | F.linear GFLOP/s | oneDNN packed | GGUF blocks |\n|---|---|---|---|---|")
    for name, mod in [("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj),
                      ("qkv", layer.self_attn.qkv_proj), ("lm_head", model.lm_head)]:
        g = mod.gguf_weight
        n, k = g.scale.shape[0], g.scale.shape[1] * 32
        w = torch.randn(n, k)
        for m in (1, 8, 16, 64, 512):
            x = torch.randn(m, k)
            flops = 2 * m * n * k
            reps = max(3, int(2e9 / flops))
            f32 = flops / timed(lambda: torch.nn.functional.linear(x, w), reps) / 1e9
            dnnl = flops / timed(lambda: packed_linear(x, mod.packed, None), reps) / 1e9
            gg = flops / timed(lambda: g.linear(x), reps) / 1e9
            print(f"| {name} | {m} | {f32:.0f} | {dnnl:.0f} | {gg:.0f} |", flush=True)
    print("\n| batch | decode step, float32 only (ms) | with GGUF blocks (ms) |\n|---|---|---|")
    for b in (1, 4, 8, 16, 24, 32):
        res = []
        for rows in (0, 64):
            gguf_blocks.MAX_ROWS = rows
            h = PagedHarness(model, num_blocks=1024)
            h.step({i: list(range(100, 228)) for i in range(b)})
            res.append(1e3 * timed(lambda: h.step({i: [5] for i in range(b)}), 10))
        print(f"| {b} | {res[0]:.1f} | {res[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
