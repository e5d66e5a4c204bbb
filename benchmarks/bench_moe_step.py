"""A decode step of a mixture of experts against one of a dense model reading as many parameters.

    python benchmarks/bench_moe_step.py MOE DENSE [--dtype float32|bfloat16] [--decodes 1,16] [--rounds 7]

MOE and DENSE are model folders or .gguf files (benchmarks/make_model.py ``--moe`` and its
dense twin ``--scale moe-twin``). Both models are loaded in this process as a worker builds
them; each round times one decode step of every model and batch size in turn (sequences of
200-token contexts, one new token each, the LM head on each), so a slow spell of the machine
falls on both alike. Prints each median over the rounds and the MoE's cost as a multiple of
the dense model's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from aiolm.attention.metadata import AttentionMetadata  # noqa: E402
from aiolm.attention.torch_backend import kv_cache_shape  # noqa: E402
from aiolm.checkpoint.source import resolve_model  # noqa: E402
from aiolm.model.registry import build_model  # noqa: E402
from aiolm.platforms import get_platform  # noqa: E402

CONTEXT, BLOCK = 200, 16


class DecodeStep:
    """One model with a KV cache for ``rows`` sequences of CONTEXT tokens."""

    def __init__(self, model: object, rows: int, kv_dtype: torch.dtype) -> None:
        cfg = model.config  # type: ignore[attr-defined]
        kv_heads = model.layers[0].self_attn.num_kv_heads  # type: ignore[attr-defined]
        per = -(-CONTEXT // BLOCK)
        self.caches = [
            torch.zeros(kv_cache_shape(rows * per + 1, BLOCK, kv_heads, cfg.head_dim), dtype=kv_dtype)
            for _ in range(cfg.num_layers)
        ]
        tables = [list(range(1 + r * per, 1 + (r + 1) * per)) for r in range(rows)]
        self.meta = AttentionMetadata.build([1] * rows, [CONTEXT] * rows, tables, BLOCK, "cpu")
        self.ids = torch.randint(0, cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
        self.pos = torch.full((rows,), CONTEXT - 1)
        self.model = model

    def __call__(self) -> float:
        t0 = time.perf_counter()
        hidden = self.model(self.ids, self.pos, self.caches, self.meta)  # type: ignore[operator]
        self.model.compute_logits(hidden)  # type: ignore[attr-defined]
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("moe")
    ap.add_argument("dense")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--decodes", default="1,16", help="sequences in a step, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    platform = get_platform("cpu")
    kv_dtype = platform.kv_cache_dtype(dtype)
    models = {
        name: build_model(resolve_model(path), dtype, "cpu") for name, path in (("moe", a.moe), ("dense", a.dense))
    }
    platform.tune_worker_process()  # the heap settings a worker process steps under
    sizes = [int(x) for x in a.decodes.split(",")]
    steps = {(name, n): DecodeStep(m, n, kv_dtype) for name, m in models.items() for n in sizes}
    for step in steps.values():  # warm-up: first-touch of the caches and the kernels' buffers
        step()
        step()
    times: dict[tuple[str, int], list[float]] = {k: [] for k in steps}
    for _ in range(a.rounds):
        for key, step in steps.items():
            times[key].append(step())
    print(f"decode step, {a.dtype}, {CONTEXT}-token contexts, medians of {a.rounds} rounds")
    for n in sizes:
        moe, dense = (statistics.median(times[(name, n)]) for name in ("moe", "dense"))
        print(
            f"  {n:3d} sequences: MoE {1e3 * moe:7.1f} ms, dense {1e3 * dense:7.1f} ms, MoE / dense {moe / dense:.2f}"
        )


if __name__ == "__main__":
    main()
