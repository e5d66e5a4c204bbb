"""Where one forward step of the real model spends its time, by op (torch profiler).

    python benchmarks/profile_step.py prefill|decode [--dtype float32|bfloat16] [--decodes N] [--model PATH]

prefill: 13 prompts, 2048 tokens (12 x 160 + 128), no cached context;
decode: 64 (--decodes) sequences with 200-token contexts, one token each. Both end with the
LM head on each sequence's last token, as the model runner does. Prints the
median step time of 5 and the profiler's table of 3 more.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["prefill", "decode"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--decodes", type=int, default=64, help="sequences in a decode step")
    ap.add_argument("--model", default=None, help="a model folder or .gguf file (default: the embedded model)")
    ap.add_argument(
        "--prompt-len", type=int, default=None, help="prefill: one prompt this long (default: 13 prompts, 2,048 tokens)"
    )
    a = ap.parse_args()
    src = resolve_model(a.model)
    model = build_model(src, getattr(torch, a.dtype), "cpu", max_positions=max(2048, a.prompt_len or 0))
    cfg, bs = src.config, 16
    kv_heads = model.layers[0].self_attn.num_kv_heads
    platform = get_platform("cpu")
    kv_dtype = platform.kv_cache_dtype(getattr(torch, a.dtype))  # as the model runner keeps it
    caches = [
        torch.zeros(kv_cache_shape(2000, bs, kv_heads, cfg.head_dim), dtype=kv_dtype) for _ in range(cfg.num_layers)
    ]
    platform.tune_worker_process()  # the heap settings a worker process steps under
    prompts = [a.prompt_len] if a.prompt_len else [160] * 12 + [128]
    qlens, slens = (prompts,) * 2 if a.step == "prefill" else ([1] * a.decodes, [200] * a.decodes)
    tables, nxt = [], 1
    for s in slens:
        n = -(-s // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    meta = AttentionMetadata.build(qlens, slens, tables, bs, "cpu")
    ids = torch.randint(0, cfg.vocab_size, (sum(qlens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(s - q, s) for q, s in zip(qlens, slens)])

    def step() -> None:
        hidden = model(ids, pos, caches, meta)
        model.compute_logits(hidden.index_select(0, meta.query_start_loc[1:] - 1))

    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(
        f"{a.step} ({a.dtype}): median {1e3 * statistics.median(times):.0f} ms of 5 "
        f"({', '.join(f'{1e3 * t:.0f}' for t in times)})"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
