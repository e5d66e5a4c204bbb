"""Time a few vision-tower layers as a CPU worker builds them, on random weights.

A SigLIP-sized layer by default (hidden 768, 12 heads, MLP 3072, images of 336 pixels in
patches of 14: 577 tokens an image), through the CPU platform's packed matmuls, kernels and
encoder attention, in float32 or bfloat16 matmuls. Prints the median of the timed steps in
ms. To compare two revisions, run it from each tree in turns:

    python benchmarks/bench_vision_tower.py --dtype bfloat16
    python benchmarks/bench_vision_tower.py --dtype float32 --images 1 --act quick_gelu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiolm.attention.cpu_backend import CpuPagedAttention  # noqa: E402
from aiolm.attention.metadata import AttentionMetadata  # noqa: E402
from aiolm.checkpoint.vision import VisionConfig  # noqa: E402
from aiolm.distributed.parallel_state import TPGroup  # noqa: E402
from aiolm.kernels import cpu as cpu_kernels  # noqa: E402
from aiolm.kernels.cpu_ops import CpuKernelOps  # noqa: E402
from aiolm.model.layers.context import BuildContext, process_weights_after_loading  # noqa: E402
from aiolm.model.layers.vision import VisionEncoderLayer  # noqa: E402
from aiolm.platforms import get_platform  # noqa: E402
from aiolm.quant import quant_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="the matmuls' dtype")
    ap.add_argument("--act", default="gelu_pytorch_tanh", help="hidden_act (SigLIP's; CLIP's is quick_gelu)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--steps", type=int, default=9)
    a = ap.parse_args()
    if not cpu_kernels.load():
        sys.exit("the CPU kernels did not build here")
    torch.manual_seed(0)
    cfg = VisionConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_layers=a.layers,
        num_heads=12,
        image_size=336,
        patch_size=14,
        hidden_act=a.act,
    )
    quant = quant_config("cpu_packed", matmul_dtype=getattr(torch, a.dtype), hand_over_bf16=True)
    ctx = BuildContext(ops=CpuKernelOps(), attention_backend=CpuPagedAttention, quant=quant, tp_group=TPGroup())
    layers = [VisionEncoderLayer(cfg, ctx, f"layers.{i}") for i in range(a.layers)]
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                norm_weight = "norm" in name and name.endswith("weight")
                p.copy_(1.0 + 0.1 * torch.randn(p.shape) if norm_weight else 0.02 * torch.randn(p.shape))
            process_weights_after_loading(layer)
    get_platform("cpu").tune_worker_process()  # the heap as a worker process has it
    lens = [cfg.num_patches + 1] * a.images  # the class row first, as CLIP's tower has it
    meta = AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16, "cpu")
    x = torch.randn(sum(lens), cfg.hidden_size)

    def step() -> torch.Tensor:
        h = x
        for layer in layers:
            h = layer(h, meta)
        return h

    with torch.inference_mode():
        for _ in range(2):
            step()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    print(
        f"{a.layers} layers, {a.images} images x {lens[0]} tokens, {a.dtype} matmuls: "
        f"median {1e3 * statistics.median(times):.1f} ms of {a.steps}"
    )


if __name__ == "__main__":
    main()
