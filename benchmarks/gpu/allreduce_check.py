"""GPU all-reduce check: symmetric memory against NCCL, correctness and decode-size latency.

    python benchmarks/gpu/allreduce_check.py            # all visible GPUs, up to 8
    python benchmarks/gpu/allreduce_check.py --ranks 2

One process per GPU, each built as a worker builds its group
(distributed/cuda_allreduce.py make_group). For each dtype and size it checks that
the group's all-reduce (symm_mem where valid) equals NCCL's on the same inputs
(within the rounding of two summation orders, relative to the sum of magnitudes)
and that all ranks hold the same result, then times both at decode sizes (tokens x
4096 hidden, bfloat16): median of CUDA-synchronized calls. With fewer than 2 GPUs
it prints why it is skipped and exits 3 (check.sh's 'skipped').
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CHECK_NUMELS = [1, 7, 4096, 64 * 4096 + 5, 3 << 20]  # the last one is larger than the peer buffer
DECODE_TOKENS = [1, 8, 32, 64, 256]
HIDDEN = 4096


def run_rank(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from aiolm.distributed.cuda_allreduce import make_group

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)  # as a worker does first (platforms/cuda.py worker_device)
    group, name = make_group(rank, world, port)
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in CHECK_NUMELS:
            g = torch.Generator(device=dev).manual_seed(1234 + rank)
            x = torch.randn(numel, device=dev, dtype=dtype, generator=g)
            want = x.clone()
            dist.all_reduce(want)  # NCCL
            got = group.all_reduce(x.clone())
            magnitude = x.abs().float()
            dist.all_reduce(magnitude)
            # the two may add in different orders: each add rounds once in float32 (or the
            # 16-bit type), and the 16-bit result once more
            bound = (world * torch.finfo(torch.float32).eps + 2 * torch.finfo(dtype).eps) * magnitude
            excess = ((got.float() - want.float()).abs() - bound).max().item()
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            same = all(torch.equal(gathered[0], t) for t in gathered[1:])
            if excess > 0 or not same:
                failures.append({"dtype": str(dtype), "numel": numel, "excess": excess, "ranks_agree": same})
    failures += _graph_failures(group, dev)
    latency = []
    for tokens in DECODE_TOKENS:
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        row = {"tokens": tokens, "bytes": x.numel() * x.element_size()}
        for label, fn in ((name, group.all_reduce), ("nccl", lambda t: dist.all_reduce(t) or t)):
            for _ in range(20):
                fn(x.clone())
            times = []
            for _ in range(200):
                y = x.clone()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fn(y)
                torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            row[label + "_us"] = statistics.median(times) * 1e6
        latency.append(row)
    if rank == 0:
        print(json.dumps({"all_reduce": name, "world": world, "failures": failures, "latency": latency}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _graph_failures(group, dev) -> list[dict]:
    """The all-reduce captured in a CUDA graph (as decode steps capture it) gives, on replay
    with new inputs copied into the captured buffer, what the eager call gives."""
    import torch

    failures = []
    for tokens in (1, 8, 64):
        static = torch.zeros(tokens, HIDDEN, device=dev, dtype=torch.bfloat16)
        group.all_reduce(static.clone())  # warm up outside the capture (allocations, handles)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = group.all_reduce(static * 1)
        for seed in (1, 2):
            g = torch.Generator(device=dev).manual_seed(seed * 7919 + group.rank)
            x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
            static.copy_(x)
            graph.replay()
            want = group.all_reduce(x.clone())
            if not torch.equal(out, want):
                failures.append(
                    {
                        "graph": True,
                        "tokens": tokens,
                        "seed": seed,
                        "max_diff": (out.float() - want.float()).abs().max().item(),
                    }
                )
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=0, help="GPUs to use (default: all visible, at most 8)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.ranks, args.port)
        return 0
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = args.ranks or min(visible, 8)
    if visible < 2 or world < 2:
        print(f"allreduce_check: skipped: {visible} CUDA device(s) visible; the all-reduce needs at least 2")
        return 3
    if world > visible:
        print(f"allreduce_check: skipped: --ranks {world} but only {visible} CUDA devices")
        return 3
    from aiolm.distributed.cuda_allreduce import symm_mem_unusable_reason

    print(
        f"allreduce_check: {world} GPUs ({torch.cuda.get_device_name(0)}); symmetric memory: "
        f"{symm_mem_unusable_reason(world) or 'usable'}"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), "--ranks", str(world), "--port", str(port)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, AIOLM_LOG_LEVEL="INFO"),
        )
        for r in range(world)
    ]
    outs = [pr.communicate(timeout=600)[0] for pr in procs]
    if any(pr.returncode for pr in procs):
        print(f"allreduce_check: FAILED: rank exit codes {[pr.returncode for pr in procs]}")
        return 1
    res = json.loads(outs[0].strip().splitlines()[-1])
    name = res["all_reduce"]
    print(f"allreduce_check: all-reduce in use: {name}")
    for f in res["failures"]:
        print(f"allreduce_check: MISMATCH {f}")
    print(f"| tokens x {HIDDEN} bf16 | bytes | {name} median (us) | nccl median (us) |\n|---|---|---|---|")
    for row in res["latency"]:
        print(f"| {row['tokens']} | {row['bytes']} | {row[name + '_us']:.1f} | {row['nccl_us']:.1f} |")
    print("allreduce_check:", "FAILED" if res["failures"] else "ok")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
