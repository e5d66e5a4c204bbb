"""What every tensor-parallel rank of a worker set agrees on about transfers in flight.

Each rank moves its own share of the KV heads, each at its own pace. A load may go into
its blocks only once every rank has its share, and a sent request's blocks may be freed
only once every rank has sent its share; and a rank that found a block bad must cut the
load there on every rank. So, at the start of each step while transfers are pending,
every rank states a number per transfer (-1: still moving; else how far it got) and all
take the smallest. The transfers are the same, in the same order, on every rank: they
arrive in the same steps' KVTransferOps.
"""

from __future__ import annotations

import torch

from aiolm.distributed.parallel_state import get_tp_group


def agree_min(values: list[int], device: torch.device) -> list[int]:
    """Each value's minimum over the tensor-parallel ranks (the values themselves on one)."""
    tp = get_tp_group()
    if tp.world_size == 1 or not values:
        return values
    mine = torch.tensor(values, dtype=torch.float32, device=device)  # small ints, exact in float32
    gathered = tp.all_gather(mine).view(tp.world_size, -1)
    return [int(v) for v in gathered.amin(0).tolist()]
