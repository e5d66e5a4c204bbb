"""Where the CPU fast path's thresholds come from: linear layers and whole decode steps.

    python benchmarks/bench_linear.py [--threads 2]

1. SmolLM2-135M's linear shapes at several batch sizes: F.linear (MKL) against
   oneDNN with the weight packed once, aiolm::panel_linear over 16-column panels
   (aiolm/quant/cpu_packed.py) and the GGUF file's own blocks
   (aiolm::gguf_linear). Weights stay in cache here, which flatters every method.
1b. All 30 layers' four linears in sequence, distinct weights per layer as in a
   real step, oneDNN against the panels (runs interleaved, medians).
1c. Each shape at 1-32 rows: the GGUF blocks with float arithmetic (aiolm::gguf_linear),
   with int8 activations (aiolm::gguf_int8_linear) and the panels, interleaved medians.
1d. TinyLlama-1.1B's shapes (make_model.py's model) as Q4_0 blocks of random codes at 1-1024
   rows: int8 x against weights in cache (one weight, called 12 times) and from memory
   (12 distinct weights, as the layers of a step), beside bfloat16 oneDNN (packed as
   `--dtype bfloat16` packs them, 12 distinct weights): where
   int8 beats bfloat16 at every size, it takes prompts (gguf_blocks.INT8_LIMIT); on AMX
   bfloat16 overtakes it between 32 and 64 rows (gguf_blocks.INT8_LIMIT_AMX_BF16).
1e. The int8 kernel's own rate: one Q4_0 weight (2048 x 2048, in cache) at 3-64 rows, the best
   of 30 calls. A minimum moves less than a median on a shared box, so this is the figure to
   compare two versions of ext/cpu/gguf_int8.cpp by (with --threads 1).
1f. A prompt's decoder layer: the real model's four linears (its GGUF blocks, int8 x) at
   2048 rows, as a 2048-token prefill step runs them 30 times; median and best of 40.
   The figure to compare versions of the kernel's threading by (with the default threads).
2. One decode step of the real model over a paged KV cache (128-token contexts)
   at batch sizes 1-32: float32 panels, the GGUF blocks in float and with int8
   activations at every batch size: this, not (1), sets gguf_blocks.MAX_ROWS and INT8_LIMIT,
   since in a real step the weights come from memory.

``--sections 1c,2`` runs only those parts.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    ap.add_argument("--sections", default="1,1b,1c,1d,2", help="comma-separated: 1, 1b, 1c, 1d, 1e, 1f, 2")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per figure (1b, 1c, 2)")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    torch.set_num_threads(a.threads)
    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model

    model = build_model(resolve_model(None))
    layer = model.layers[0]
    layers = [
        ("gate_up", layer.mlp.gate_up_proj),
        ("down", layer.mlp.down_proj),
        ("qkv", layer.self_attn.qkv_proj),
        ("o", layer.self_attn.o_proj),
        ("lm_head", model.lm_head),
    ]
    if "1" in sections:
        per_layer_methods(layers)
    shapes = [(mod.gguf.blocks.n, mod.gguf.blocks.scale.shape[1] // 8 * 32) for _, mod in layers[:4]]
    if "1b" in sections:
        layer_sequence(shapes, a.rounds)
    if "1c" in sections:
        int8_crossover(layers, a.rounds)
    if "1d" in sections:
        int8_tinyllama(a.rounds)
    if "1e" in sections:
        int8_kernel_rate()
    if "1f" in sections:
        int8_prompt_layer([mod.gguf.blocks for _, mod in layers[:4]], shapes)
    if "2" in sections:
        decode_steps(model, a.rounds)


def per_layer_methods(layers) -> None:
    from aiolm.quant.cpu_packed import to_panels

    print("| layer | rows | F.linear GFLOP/s | oneDNN packed | panels | GGUF blocks |\n|---|---|---|---|---|---|")
    for name, mod in layers:
        g = mod.gguf.blocks
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


def layer_sequence(shapes, rounds: int) -> None:
    from aiolm.quant.cpu_packed import to_panels

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

        a, b = interleaved([run_dnnl, run_panels], rounds)
        flops = 30 * sum(2 * m * n * k for n, k in shapes)
        print(f"| {m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {flops / b / 1e9:.0f} |", flush=True)


def int8_crossover(layers, rounds: int) -> None:
    """Microseconds per call of one layer's weights: short timed runs (5 calls), so that on a
    shared machine most runs fit in one time slice and the median is the unloaded speed."""
    from aiolm.quant.cpu_packed import to_panels

    print(
        "\n| layer (N x K, type) | rows | GGUF blocks, float (µs) | GGUF blocks, int8 x (µs) | panels (µs) |"
        "\n|---|---|---|---|---|"
    )
    for name, mod in layers:
        g = mod.gguf.blocks
        n, k = g.n, g.scale.shape[1] // 8 * 32
        panels = to_panels(torch.randn(n, k))
        kind = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}[g.qtype]
        for m in (1, 2, 4, 6, 8, 12, 16, 24, 32):
            x = torch.randn(m, k)
            calls = 5

            def rep(f):
                return lambda: [f() for _ in range(calls)]

            t = interleaved(
                [
                    rep(lambda: g.linear(x)),
                    rep(lambda: g.linear_int8(x)),
                    rep(lambda: torch.ops.aiolm.panel_linear(x, panels, n)),
                ],
                rounds,
            )
            f, i, p = (1e6 * v / calls for v in t)
            print(f"| {name} ({n} x {k}, {kind}) | {m} | {f:.0f} | {i:.0f} | {p:.0f} |", flush=True)


ROWS_1D = [1, 2, 4, 8, 11, 16, 32, 64, 256, 1024]  # 32-64: where bfloat16 on AMX tiles overtakes int8


def random_blocks(n: int, k: int, rng, qtype: str = "Q4_0"):
    """An n x k weight of random codes in GGUF blocks (Q4_0, Q4_1 or Q8_0), every block's
    scale 0.01 (Q4_1's mins -0.08)."""
    import numpy as np

    from aiolm.quant.gguf_blocks import GGUFWeight

    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
    b = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    b[:, :, 0:2] = np.full((n, k // 32, 1), 0.01, np.float16).view(np.uint8)
    if qtype == "Q4_1":
        b[:, :, 2:4] = np.full((n, k // 32, 1), -0.08, np.float16).view(np.uint8)
    return GGUFWeight.from_blocks(b.reshape(n, -1), qtype)


def int8_tinyllama(rounds: int) -> None:
    import numpy as np

    from aiolm.quant.cpu_packed import pack_weight

    rng = np.random.default_rng(0)

    print(
        "\n| layer (N x K) | rows | int8 x, in cache (GOP/s) | int8 x, from memory | bfloat16 oneDNN, from memory |"
        "\n|---|---|---|---|---|"
    )
    for name, n, k in [("gate_up", 11264, 2048), ("down", 2048, 5632), ("qkv", 2560, 2048)]:
        ws = [random_blocks(n, k, rng) for _ in range(12)]
        wbs = [pack_weight(w.dequantize(), torch.bfloat16) for w in ws]  # as --dtype bfloat16 packs them
        for m in ROWS_1D:
            x = torch.randn(m, k)

            def cached() -> None:
                for _ in ws:
                    ws[0].linear_int8(x)

            def memory() -> None:
                for w in ws:
                    w.linear_int8(x)

            def bf16() -> None:
                for w in wbs:
                    w(x)

            t = interleaved([cached, memory, bf16], rounds)
            ops = 2 * m * n * k * len(ws)
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(f"{ops / v / 1e9:.0f}" for v in t) + " |", flush=True)


def int8_kernel_rate() -> None:
    import numpy as np

    w = random_blocks(2048, 2048, np.random.default_rng(0))
    rows = (3, 4, 6, 8, 11, 12, 16, 24, 48, 64)
    best = {}
    for m in rows:
        x = torch.randn(m, 2048)
        calls = max(1, 64 // m)
        w.linear_int8(x)
        t = []
        for _ in range(30):
            t0 = time.perf_counter()
            for _ in range(calls):
                w.linear_int8(x)
            t.append((time.perf_counter() - t0) / calls)
        best[m] = 2 * m * 2048 * 2048 / min(t) / 1e9
    print(f"\n| rows | {' | '.join(map(str, rows))} |\n|---|{'---|' * len(rows)}")
    print(
        f"| int8 x, Q4_0 2048 x 2048, GOP/s ({torch.get_num_threads()} threads) | "
        + " | ".join(f"{best[m]:.0f}" for m in rows)
        + " |"
    )


def int8_prompt_layer(blocks, shapes) -> None:
    from aiolm.quant.gguf_blocks import TYPE_IDS

    rows, names = 2048, {v: k for k, v in TYPE_IDS.items()}
    xs = [torch.randn(rows, k) for _, k in shapes]
    ops = sum(2 * rows * n * k for n, k in shapes)

    def layer() -> None:
        for b, x in zip(blocks, xs):
            b.linear_int8(x)

    for _ in range(3):
        layer()
    t = []
    for _ in range(40):
        t0 = time.perf_counter()
        layer()
        t.append(time.perf_counter() - t0)
    med = statistics.median(t)
    types = ", ".join(names[b.qtype] for b in blocks)
    print(
        f"\n| {rows} rows, qkv + o + gate_up + down, int8 x ({torch.get_num_threads()} threads) | median (ms) |"
        f" best (ms) | GOP/s at the median |\n|---|---|---|---|\n| {types} | {med * 1e3:.1f} |"
        f" {min(t) * 1e3:.1f} | {ops / med / 1e9:.0f} |"
    )


def decode_steps(model, rounds: int) -> None:
    from aiolm.quant import gguf_blocks
    from paged import PagedHarness

    # Each layer's int8 limit is fixed when its blocks are attached: lift it, so that the int8
    # column is int8 at every batch size (the fused layers read it too).
    for m in model.modules():
        if isinstance(getattr(m, "gguf", None), gguf_blocks.GGUFLinear):
            m.gguf = dataclasses.replace(m.gguf, int8_rows=64)
    for layer in model.layers:
        layer.fused = gguf_blocks.FusedDecodeLayer.of(layer)
    names = ("MAX_ROWS", "INT8")
    modes = {"panels": (0, False), "blocks, float": (64, False), "blocks, int8 x": (64, True)}
    saved = [getattr(gguf_blocks, n) for n in names]
    print(
        "\n| batch | decode step, float32 panels (ms) | GGUF blocks, float (ms) | GGUF blocks, int8 x (ms) |"
        "\n|---|---|---|---|"
    )
    for b in (1, 2, 4, 6, 8, 12, 16, 24, 32):
        h = PagedHarness(model, num_blocks=1024)
        h.step({i: list(range(100, 228)) for i in range(b)})

        def step(mode: str):
            def run() -> None:
                for n, v in zip(names, modes[mode]):
                    setattr(gguf_blocks, n, v)
                h.step({i: [5] for i in range(b)})
                h.lens = {i: 128 for i in range(b)}  # every step decodes at position 128

            return run

        t = interleaved([step(m) for m in modes], rounds)
        print(f"| {b} | " + " | ".join(f"{1e3 * v:.1f}" for v in t) + " |", flush=True)
    for n, v in zip(names, saved):
        setattr(gguf_blocks, n, v)


def onednn(w: torch.Tensor):
    from aiolm.quant.cpu_packed import PackedWeight

    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64), w.shape[0], panels=False)


def interleaved(fns, rounds: int) -> list[float]:
    """Median seconds of each function, run in turns so that load on the machine hits all alike."""
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for f, ts in zip(fns, times):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


if __name__ == "__main__":
    main()
