"""Where the CPU fast path's thresholds come from: linear layers and whole decode steps.

    python benchmarks/bench_linear.py [--threads 2]

1. SmolLM2-135M's linear shapes at several batch sizes: F.linear (MKL) against
   oneDNN with the weight packed once, aiolm::panel_linear over 16-column panels
   (platforms/cpu_linear.py) and the GGUF file's own blocks
   (aiolm::gguf_linear). Weights stay in cache here, which flatters every method.
1b. All 30 layers' four linears in sequence, distinct weights per layer as in a
   real step, oneDNN against the panels (runs interleaved, medians).
2. One decode step of the real model over a paged KV cache (128-token contexts)
   at batch sizes 1-32, with the GGUF-block path off and on: this, not (1), sets
   gguf_blocks.MAX_ROWS, since in a real step the weights come from memory.
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

    from aiolm.platforms import gguf_blocks
    from aiolm.platforms.cpu_linear import to_panels
    from aiolm.model.loader import resolve_model
    from aiolm.model.registry import build_model

    model = build_model(resolve_model(None))
    layer = model.layers[0]
    layers = [("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj),
              ("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("lm_head", model.lm_head)]
    print("| layer | rows | F.linear GFLOP/s | oneDNN packed | panels | GGUF blocks |\n|---|---|---|---|---|---|")
    for name, mod in layers:
        g = mod.method.blocks
        n, k = g.n, g.scale.shape[1] // 8 * 32
        w = torch.randn(n, k)
        dnnl_w, panels = onednn(w), to_panels(w)
        for m in (1, 8, 16, 64, 512):
            x = torch.randn(m, k)
            flops = 2 * m * n * k
            reps = max(3, int(2e9 / flops))
            f32 = flops / timed(lambda: torch.nn.functional.linear(x, w), reps) / 1e9
            dnnl = flops / timed(lambda: dnnl_w(x), reps) / 1e9
            pan = flops / timed(lambda: torch.ops.aiolm.panel_linear(x, panels, n), reps) / 1e9
            gg = flops / timed(lambda: g.linear(x), reps) / 1e9
            print(f"| {name} | {m} | {f32:.0f} | {dnnl:.0f} | {pan:.0f} | {gg:.0f} |", flush=True)

    shapes = [(mod.method.blocks.n, mod.method.blocks.scale.shape[1] // 8 * 32) for _, mod in layers[:4]]
    print("\n| rows | 30 layers' linears, oneDNN (ms) | panels (ms) | panels GFLOP/s |\n|---|---|---|---|")
    for m in (16, 32, 64, 128, 512, 2048):
        weights = [[torch.randn(n, k) for n, k in shapes] for _ in range(30)]
        dnnl_ws = [[onednn(w) for w in ws] for ws in weights]
        panel_ws = [[to_panels(w) for w in ws] for ws in weights]
        xs = {k: torch.randn(m, k) for _, k in shapes}

        def run_dnnl() -> None:
            for ws in dnnl_ws:
                for (_, k), w in zip(shapes, ws):
                    w(xs[k])

        def run_panels() -> None:
            for ws in panel_ws:
                for (n, k), w in zip(shapes, ws):
                    torch.ops.aiolm.panel_linear(xs[k], w, n)

        a, b = interleaved(run_dnnl, run_panels, 5)
        flops = 30 * sum(2 * m * n * k for n, k in shapes)
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {flops / b / 1e9:.0f} |", flush=True)

    print("\n| batch | decode step, float32 panels (ms) | with GGUF blocks (ms) |\n|---|---|---|")
    for b in (1, 4, 8, 16, 24, 32):
        res = []
        for rows in (0, 64):
            gguf_blocks.MAX_ROWS = rows
            h = PagedHarness(model, num_blocks=1024)
            h.step({i: list(range(100, 228)) for i in range(b)})
            res.append(1e3 * timed(lambda: h.step({i: [5] for i in range(b)}), 10))
        print(f"| {b} | {res[0]:.1f} | {res[1]:.1f} |", flush=True)


def onednn(w: torch.Tensor):
    from aiolm.platforms.cpu_linear import PackedWeight

    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64), w.shape[0], panels=False)


def interleaved(f, g, rounds: int) -> tuple[float, float]:
    """Median seconds of f and g, run alternately so that load on the machine hits both."""
    f(), g()
    tf, tg = [], []
    for _ in range(rounds):
        for fn, ts in ((f, tf), (g, tg)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(tf), statistics.median(tg)


if __name__ == "__main__":
    main()
