"""Which all-reduce a tensor-parallel group runs, and building that group.

Layers only see ``TPGroup`` (parallel_state.py); this module decides what stands
behind its ``all_reduce`` / ``all_gather``:

==========  ======  =========================================================
name        device  what
==========  ======  =========================================================
shm         cpu     shm_allreduce.py: one shared segment, no copies through sockets
gloo        cpu     torch.distributed over loopback TCP (the fallback)
symm_mem    cuda    torch's symmetric-memory all-reduce over peer memory (cuda_allreduce.py)
nccl        cuda    torch.distributed's NCCL (the fallback)
==========  ======  =========================================================

``auto`` picks the first usable one of the device's pair. The choice can be forced
per engine (``--all-reduce``) or, for tests and experiments, with the environment
variable ``AIOLM_ALL_REDUCE`` when the engine leaves it at ``auto``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of the engine process's EngineArgs checks
    from aiolm.distributed.parallel_state import TPGroup

log = logging.getLogger(__name__)

ENV_VAR = "AIOLM_ALL_REDUCE"
CHOICES = ("auto", "shm", "gloo", "symm_mem", "nccl")
_BY_DEVICE = {"cpu": ("shm", "gloo"), "cuda": ("symm_mem", "nccl")}


def requested_all_reduce(requested: str = "auto") -> str:
    """``requested``, or the environment's choice when it is ``auto``; checked against CHOICES."""
    if requested == "auto":
        requested = os.environ.get(ENV_VAR, "auto") or "auto"
    if requested not in CHOICES:
        raise ValueError(f"all_reduce: {requested!r} is not supported; supported: {', '.join(CHOICES)}")
    return requested


def check_for_device(requested: str, device_type: str) -> None:
    """Refuse a choice the device cannot run (e.g. shm for CUDA tensors)."""
    allowed = _BY_DEVICE.get(device_type, ())
    if requested != "auto" and requested not in allowed:
        raise ValueError(
            f"all_reduce: {requested!r} does not run on {device_type}; supported there: auto, {', '.join(allowed)}"
        )


def make_tp_group(
    rank: int,
    world_size: int,
    device_type: str,
    requested: str = "auto",
    *,
    shm_name: str | None = None,
    port: int = 0,
    host: str = "127.0.0.1",
) -> tuple[TPGroup, str]:
    """This rank's group and the name of the all-reduce behind it (``none`` for one rank).

    The platform calls this once per worker before building the model. ``shm_name``
    is the segment the engine created for the CPU all-reduce (None if it could not);
    ``host``:``port`` is the rendezvous for gloo / NCCL (loopback unless the group spans
    machines).
    """
    from aiolm.distributed.parallel_state import TPGroup

    if world_size == 1:
        return TPGroup(), "none"
    requested = requested_all_reduce(requested)
    check_for_device(requested, device_type)
    if device_type == "cuda":
        from aiolm.distributed import cuda_allreduce

        group, name = cuda_allreduce.make_group(rank, world_size, port, prefer_symm_mem=requested != "nccl", host=host)
        if requested == "symm_mem" and name != "symm_mem":
            raise RuntimeError(
                "all_reduce 'symm_mem' was asked for but is not usable here (see the log line above); use auto or nccl"
            )
    elif requested in ("auto", "shm") and shm_name is not None:
        from aiolm.distributed.shm_allreduce import ShmAllReduce

        comm = ShmAllReduce(shm_name, rank)
        group, name = TPGroup(rank, world_size, comm.all_reduce, comm.all_gather), "shm"
    elif requested == "shm":
        raise RuntimeError("all_reduce 'shm' was asked for but the engine made no shared segment")
    else:
        from aiolm.distributed.gloo_group import make_group

        group, name = make_group(rank, world_size, port, host), "gloo"
    if rank == 0:
        log.info("tensor parallel: %d ranks on %s, all-reduce: %s", world_size, device_type, name)
    return group, name
