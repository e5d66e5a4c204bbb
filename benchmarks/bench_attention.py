"""Decode attention over a paged KV cache: 64 requests x 256 keys, 30 layers' caches.

    OMP_NUM_THREADS=2 python benchmarks/bench_attention.py

Pages are placed at random and each layer has its own cache, so K/V come from
memory as in a real step; prints the time of the 30 layers and the bytes of K/V
read per second (this machine reads ~17 GB/s with 2 threads).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from aiolm.kernels import cpu  # noqa: E402

assert cpu.load(), "the CPU kernels did not build"
B, ctx, H, KVH, D, bs, L = 64, 256, 9, 3, 64, 16, 30
nb_per = ctx // bs
nblocks = B * nb_per + 8
g = torch.Generator().manual_seed(0)
caches = [(torch.randn(nblocks, bs, KVH, D), torch.randn(nblocks, bs, KVH, D)) for _ in range(L)]
table = torch.randperm(nblocks - 8, generator=g)[:B * nb_per].view(B, nb_per).contiguous().long()
q = torch.randn(B, H, D); out = torch.empty_like(q)
qsl = torch.arange(B + 1, dtype=torch.long); sl = torch.full((B,), ctx, dtype=torch.long)
def run():
    for kc, vc in caches:
        torch.ops.aiolm.paged_attention(out, q, kc, vc, table, qsl, sl, 0.125)
run(); ts=[]
for _ in range(9):
    t0=time.perf_counter(); run(); ts.append(time.perf_counter()-t0)
mb = B*ctx*KVH*D*2*4*L/1e6
t=statistics.median(ts)
print(f"30 layers {t*1e3:.1f} ms  ({t*1e3/L:.2f} ms/layer, {mb/t/1e3:.1f} GB/s)")
