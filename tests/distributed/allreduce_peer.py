"""One rank of the shared-memory all-reduce tests, run as its own process.

``python tests/distributed/allreduce_peer.py cases NAME RANK``: run every case of
``cases(slot_elems)`` and print one JSON line with a digest of each result, so the
test can compare ranks bit for bit. Each rank can make every rank's input (seeded
by case and rank), so it checks its own result against the float64 sum itself.

``... wait NAME RANK``: rank 0 enters one all-reduce, prints how it ended (its
peer is SIGKILLed by the test instead of arriving); other ranks only attach and sleep.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from aiolm.distributed.shm_allreduce import PeerDied, ShmAllReduce  # noqa: E402

torch.set_num_threads(1)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cases(slot_bytes: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, dtype, shape): 1 element up to 4 slots and a bit, per dtype; gathers by rows and flat."""
    out = []
    for dt, t in DTYPES.items():
        e = slot_bytes // t.itemsize
        for n in (1, 7, e - 1, e, e + 1, 4 * e, 4 * e + 3):
            out.append(("all_reduce", dt, (n,)))
        out.append(("all_reduce", dt, (5, e // 3 + 1)))
        out.append(("all_reduce_t", dt, (e // 8 + 3, 5)))  # a transposed (non-contiguous) view
    out.append(("all_gather", "float32", (1, 3)))
    out.append(("all_gather", "float32", (37, slot_bytes // 4 // 5)))  # several rows per slot, chunked
    out.append(("all_gather", "float32", (3, slot_bytes // 4 + 5)))  # a row longer than a slot
    out.append(("all_gather", "bfloat16", (4, 100)))
    return out


def make_input(case: int, rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)


def run_cases(comm: ShmAllReduce) -> list[str]:
    digests = []
    world = comm.world_size
    for i, (op, dt, shape) in enumerate(cases(comm.slot_bytes)):
        dtype = DTYPES[dt]
        inputs = [make_input(i, r, dtype, shape) for r in range(world)]
        if op == "all_gather":
            got = comm.all_gather(inputs[comm.rank].clone())
            want = torch.cat(inputs, dim=-1)
            assert torch.equal(got, want), f"case {i}: all_gather differs"
        else:
            x = inputs[comm.rank].clone()
            if op == "all_reduce_t":
                x = x.t()
            got = comm.all_reduce(x)
            assert got is x, f"case {i}: not in place"
            if op == "all_reduce_t":
                got = got.t()
            exact = sum(t.double() for t in inputs)
            magnitude = sum(t.double().abs() for t in inputs)
            # float32 accumulation: (world - 1) roundings of float32, then one to the dtype
            bound = world * torch.finfo(torch.float32).eps * magnitude + torch.finfo(dtype).eps * exact.abs() + 1e-30
            err = (got.double() - exact).abs()
            assert bool((err <= bound).all()), f"case {i} {op} {dt} {shape}: max err {float(err.max())}"
        digests.append(hashlib.sha256(got.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
    return digests


def main() -> int:
    mode, name, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    comm = ShmAllReduce(name, rank, timeout_s=float(sys.argv[4]) if len(sys.argv) > 4 else 60.0)
    if mode == "cases":
        print(json.dumps({"rank": rank, "digests": run_cases(comm)}), flush=True)
        return 0
    if rank != 0:
        print("attached", flush=True)
        time.sleep(300)
        return 0
    print("attached", flush=True)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(10))
    except (PeerDied, TimeoutError) as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "waited": time.monotonic() - t0}), flush=True)
        return 3
    print(json.dumps({"error": None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
