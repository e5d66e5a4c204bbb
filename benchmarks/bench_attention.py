"""Attention over a paged KV cache: a decode step (64 requests x 256 keys, 30 layers'
caches) and one layer of a 2048-token prefill (12 prompts of 160 tokens and one of 128).

    OMP_NUM_THREADS=2 python benchmarks/bench_attention.py [--library OLD.so]

``--library`` loads another build of the kernels (an older commit's, say) instead of
the cache's, so two builds can be timed in turns; the window line is skipped for a build
without windows. Each line gives the median of its repeats and, in brackets, the fastest,
which on a busy machine is the steadier of the two.

Pages are placed at random and each layer has its own cache, so K/V come from
memory as in a real step; prints the time of the 30 layers and the bytes of K/V
read per second (to set beside the machine's own read bandwidth), for a float32
cache and a float16 one (what `--dtype bfloat16` keeps); the same step with a
64-key sliding window (Mistral, Gemma 3's local layers: a row reads only its
window's pages); then the prefill layer's time and GFLOP/s.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from aiolm.kernels import cpu  # noqa: E402

if "--library" in sys.argv:
    torch.ops.load_library(sys.argv[sys.argv.index("--library") + 1])
    cpu._state["ok"] = True  # the library just loaded stands in for the cache's build
assert cpu.load(), "the CPU kernels did not build"
B, ctx, H, KVH, D, bs, L = 64, 256, 9, 3, 64, 16, 30
nb_per = ctx // bs
nblocks = B * nb_per + 8
g = torch.Generator().manual_seed(0)
table = torch.randperm(nblocks - 8, generator=g)[: B * nb_per].view(B, nb_per).contiguous().long()
q = torch.randn(B, H, D)
out = torch.empty_like(q)
qsl = torch.arange(B + 1, dtype=torch.long)
sl = torch.full((B,), ctx, dtype=torch.long)
for dtype in (torch.float16, torch.float32):
    caches = [
        (torch.randn(nblocks, bs, KVH, D).to(dtype), torch.randn(nblocks, bs, KVH, D).to(dtype)) for _ in range(L)
    ]

    def run():
        for kc, vc in caches:
            torch.ops.aiolm.paged_attention(out, q, kc, vc, table, qsl, sl, 0.125)

    run()
    ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    mb = B * ctx * KVH * D * 2 * dtype.itemsize * L / 1e6
    t = statistics.median(ts)
    print(
        f"decode, {str(dtype)[6:]} cache: 30 layers {t * 1e3:.1f} ms [{min(ts) * 1e3:.1f}] "
        f"({t * 1e3 / L:.2f} ms/layer, {mb / t / 1e3:.1f} GB/s)"
    )


def run_window():
    for kc, vc in caches:
        torch.ops.aiolm.paged_attention(out, q, kc, vc, table, qsl, sl, 0.125, 64)


if "window" in str(torch.ops.aiolm.paged_attention.default._schema):  # builds before windows lack it
    run_window()
    ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        run_window()
        ts.append(time.perf_counter() - t0)
    print(f"30 layers, 64-key window: {statistics.median(ts) * 1e3:.1f} ms [{min(ts) * 1e3:.1f}]")

lens = [160] * 12 + [128]
tables, nxt = [], 0
for n in lens:
    tables.append(list(range(nxt, nxt + n // bs)))
    nxt += n // bs
pk, pv = torch.randn(nxt, bs, KVH, D), torch.randn(nxt, bs, KVH, D)
pt = torch.tensor(tables[:-1] + [tables[-1] + [0, 0]], dtype=torch.long)
pq = torch.randn(sum(lens), H, D)
pout = torch.empty_like(pq)
pqsl = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.long)
psl = torch.tensor(lens, dtype=torch.long)


def prefill():
    torch.ops.aiolm.paged_attention(pout, pq, pk, pv, pt, pqsl, psl, 0.125)


prefill()
ts = []
for _ in range(15):
    t0 = time.perf_counter()
    prefill()
    ts.append(time.perf_counter() - t0)
t = statistics.median(ts)
flops = sum(n * (n + 1) / 2 for n in lens) * H * D * 4
print(f"prefill, one layer, {sum(lens)} tokens: {t * 1e3:.2f} ms [{min(ts) * 1e3:.2f}] ({flops / t / 1e9:.0f} GFLOP/s)")
