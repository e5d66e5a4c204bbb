"""All-reduce between the GPUs of one node: torch's symmetric memory, else NCCL.

Why symmetric memory: at decode sizes (a few hundred KB) NCCL's ring spends its
time in launch and protocol latency. With peer memory each rank copies its
tensor into a buffer every peer can read over NVLink/P2P, and one kernel per
rank sums all buffers (``one_shot_all_reduce``) or reduces a share and gathers
(``two_shot_all_reduce_`` for larger tensors). It is valid only inside one node,
for 2-8 GPUs that can all reach each other's memory, and only where the torch
build ships ``torch.distributed._symmetric_memory``; everything else, and
tensors larger than the buffer, go through NCCL.

Rank r uses ``cuda:r`` (the executor starts ranks on one node).
"""

from __future__ import annotations

import importlib
import logging

import torch
import torch.distributed as dist

from aiolm.distributed.gloo_group import collectives
from aiolm.distributed.parallel_state import TPGroup

log = logging.getLogger(__name__)

SYMM_MEM_BYTES = 8 << 20  # the peer buffer; larger tensors go through NCCL
ONE_SHOT_MAX_BYTES = 512 << 10  # above this the two-shot kernel moves less data per rank


def symm_mem_unusable_reason(world_size: int) -> str | None:
    """Why symmetric memory cannot serve ``world_size`` ranks here, or None if it can."""
    if not 2 <= world_size <= 8:
        return f"{world_size} ranks (symmetric memory all-reduce serves 2-8)"
    if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
        return f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} visible GPUs for {world_size} ranks"
    try:
        # `import torch.distributed...` here would make `torch` a local name of this whole function
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return "this torch build has no torch.distributed._symmetric_memory"
    for i in range(world_size):
        for j in range(world_size):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                return f"GPU {i} cannot access GPU {j}'s memory (no P2P)"
    return None


class SymmMemAllReduce:
    """One rank's peer buffer and the kernels that sum through it."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, nbytes: int = SYMM_MEM_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(self.group_name):
            enable(self.group_name)  # older torch builds ask for this first
        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.nbytes = nbytes

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.nbytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() * x.element_size()
        staged = self.buffer[:n].view(x.dtype).view(x.shape)
        staged.copy_(x)
        if n <= ONE_SHOT_MAX_BYTES:
            return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        return x.copy_(staged)


def make_group(
    rank: int, world_size: int, port: int, prefer_symm_mem: bool = True, host: str = "127.0.0.1"
) -> tuple[TPGroup, str]:
    """Join the NCCL group on the current GPU (the worker made its rank's device current:
    platforms/cuda.py worker_device) and put symmetric memory in front of it where valid."""
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        "nccl", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size, device_id=device
    )
    group = dist.group.WORLD
    assert group is not None

    nccl_all_reduce, all_gather = collectives(world_size)

    reason = symm_mem_unusable_reason(world_size) if prefer_symm_mem else "nccl was asked for"
    symm: SymmMemAllReduce | None = None
    if reason is None:
        try:
            symm = SymmMemAllReduce(group, device)
        except Exception as e:  # a driver or build that cannot map peer memory
            reason = f"setting up symmetric memory failed: {type(e).__name__}: {e}"
    if symm is None:
        if rank == 0:
            log.info("CUDA all-reduce: nccl (%s)", reason)
        return TPGroup(rank, world_size, nccl_all_reduce, all_gather), "nccl"

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        return symm.all_reduce(x) if symm.fits(x) else nccl_all_reduce(x)

    if rank == 0:
        log.info(
            "CUDA all-reduce: symm_mem (torch symmetric memory, %d MiB peer buffer; NCCL above it)",
            SYMM_MEM_BYTES >> 20,
        )
    return TPGroup(rank, world_size, all_reduce, all_gather), "symm_mem"
