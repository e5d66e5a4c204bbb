"""A tensor-parallel group over torch.distributed's gloo backend, over TCP.

The CPU fallback for world_size > 1 and the all-reduce of groups that span
machines (the Ray executor): correct everywhere, not the fastest. The rendezvous
address is chosen by the engine (loopback, or rank 0's node on Ray).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from aiolm.distributed.parallel_state import TPGroup


def make_group(rank: int, world_size: int, port: int, host: str = "127.0.0.1") -> TPGroup:
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
    return TPGroup(rank, world_size, *collectives(world_size))


def collectives(
    world_size: int,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """All-reduce (in place) and all-gather (concatenated on the last dim) over the default
    torch.distributed group, whatever its backend (gloo here, NCCL in cuda_allreduce.py)."""

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    return all_reduce, all_gather
