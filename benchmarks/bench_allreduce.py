"""Median latency of the CPU all-reduce between tensor-parallel ranks: shm vs gloo.

    python benchmarks/bench_allreduce.py                      # 2 and 3 ranks, 4 KB .. 4 MB
    python benchmarks/bench_allreduce.py --ranks 2 --impl shm --sizes 147456

Each rank is its own process built the way a worker builds its group
(distributed/communicator.py make_tp_group, cores split by cpu_bind.bind_rank),
calls all_reduce on a float32 tensor back to back, and rank 0 reports the median
and p90 of its per-call times. 147456 bytes is one decode step's hidden states
for 64 requests of a 576-wide model (64 x 576 float32).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [4 << 10, 16 << 10, 64 << 10, 64 * 576 * 4, 256 << 10, 1 << 20, 4 << 20]


def _iters(nbytes: int) -> int:
    return max(30, min(1000, (64 << 20) // nbytes))


def run_rank(args: argparse.Namespace) -> None:
    import torch

    from aiolm.distributed.communicator import make_tp_group
    from aiolm.distributed.cpu_bind import bind_rank

    bind_rank(args.rank, args.world, "auto")
    group, name = make_tp_group(args.rank, args.world, "cpu", args.impl, shm_name=args.name or None, port=args.port)
    results = []
    for nbytes in args.sizes:
        x = torch.randn(nbytes // 4)
        for _ in range(10):
            group.all_reduce(x.clone())
        times = []
        for _ in range(_iters(nbytes)):
            y = x.clone()
            t0 = time.perf_counter()
            group.all_reduce(y)
            times.append(time.perf_counter() - t0)
        times.sort()
        results.append(
            {
                "bytes": nbytes,
                "median_us": statistics.median(times) * 1e6,
                "p90_us": times[int(len(times) * 0.9)] * 1e6,
                "iters": len(times),
            }
        )
    if args.rank == 0:
        print(json.dumps({"impl": name, "world": args.world, "results": results}), flush=True)
    if torch.distributed.is_initialized():  # gloo's threads must stop before the process exits
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(world: int, impl: str, sizes: list[int]) -> dict:
    from aiolm.distributed.shm_allreduce import create_segment

    name, unlink = create_segment(world) if impl == "shm" else ("", lambda: False)
    port = _free_port()
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--impl",
                    impl,
                    "--name",
                    name,
                    "--port",
                    str(port),
                    "--sizes",
                    *map(str, sizes),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{impl} x{world}: a rank failed: {[p.returncode for p in procs]}")
        return json.loads(outs[0].strip().splitlines()[-1])
    finally:
        unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--impl", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"])
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes of float32 per call")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--name", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        args.impl = args.impl[0]
        run_rank(args)
        return
    print(f"cpus allowed: {len(os.sched_getaffinity(0))}")
    table: dict[tuple[int, int], dict[str, float]] = {}
    for world in args.ranks:
        for impl in args.impl:
            out = run_group(world, impl, args.sizes)
            for r in out["results"]:
                table.setdefault((world, r["bytes"]), {})[impl] = r["median_us"]
                print(
                    f"{impl:>4} x{world}  {r['bytes']:>8} B  median {r['median_us']:9.1f} us  "
                    f"p90 {r['p90_us']:9.1f} us  ({r['iters']} calls)",
                    flush=True,
                )
    if set(args.impl) == {"shm", "gloo"}:
        print("\n| ranks | bytes | shm median (us) | gloo median (us) | gloo / shm |\n|---|---|---|---|---|")
        for (world, nbytes), row in sorted(table.items()):
            print(f"| {world} | {nbytes} | {row['shm']:.1f} | {row['gloo']:.1f} | {row['gloo'] / row['shm']:.1f}x |")


if __name__ == "__main__":
    main()
