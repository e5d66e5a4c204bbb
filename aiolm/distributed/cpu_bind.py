"""Pin each tensor-parallel rank of one machine to its own cores.

Why: ranks wait for each other at every all-reduce, so one rank whose threads
share cores with another rank's makes every rank wait. The automatic split gives
each rank a contiguous block of the physical cores this process may use (with
their SMT siblings) and as many torch threads as it has physical cores. With
more ranks than cores there is no disjoint split: ranks are left unpinned with
one thread each, and the log says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def _core_key(cpu: int) -> tuple[int, int] | None:
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text())
    except (OSError, ValueError):
        return None


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (SMT siblings together), in order of first cpu."""
    groups: dict[object, list[int]] = {}
    for c in sorted(cpus):
        key = _core_key(c)
        groups.setdefault(key if key is not None else ("cpu", c), []).append(c)
    return list(groups.values())


def split_cpus(cpus: list[int], world_size: int) -> list[list[int]] | None:
    """Disjoint blocks of ``cpus`` for ``world_size`` ranks, or None when there are fewer
    physical cores than ranks. Earlier ranks get one core more when it does not divide."""
    cores = physical_cores(cpus)
    if len(cores) < world_size:
        return None
    base, extra = divmod(len(cores), world_size)
    out, i = [], 0
    for r in range(world_size):
        n = base + (r < extra)
        out.append(sorted(c for core in cores[i : i + n] for c in core))
        i += n
    return out


def parse_cpu_bind(spec: str, world_size: int) -> list[list[int]] | None:
    """``auto``, ``none``, or one cpu list per rank separated by ``;`` (``0-3,8;4-7``)."""
    if spec in ("auto", "none"):
        return None
    parts = spec.split(";")
    if len(parts) != world_size:
        raise ValueError(f"cpu_bind: {spec!r} names {len(parts)} cpu lists for {world_size} ranks")
    allowed = os.sched_getaffinity(0)
    out = []
    for part in parts:
        cpus: list[int] = []
        for item in part.split(","):
            lo, _, hi = item.strip().partition("-")
            try:
                cpus.extend(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise ValueError(f"cpu_bind: {part!r} is not a cpu list like 0-3,8") from None
        if not cpus:
            raise ValueError(f"cpu_bind: {part!r} names no cpu")
        outside = sorted(set(cpus) - allowed)
        if outside:
            raise ValueError(
                f"cpu_bind: cpu {outside[0]} is not one this process may run on (it may use {_ranges(sorted(allowed))})"
            )
        out.append(cpus)
    return out


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def bind_rank(rank: int, world_size: int, spec: str = "auto") -> list[int] | None:
    """Pin this process (rank ``rank``) as ``spec`` says and size torch's thread pool;
    returns the cpus it runs on, or None if it was left unpinned."""
    import torch

    if spec == "none" or (spec == "auto" and world_size == 1):  # one rank: its cpus, unless named
        return None
    explicit = parse_cpu_bind(spec, world_size)
    allowed = sorted(os.sched_getaffinity(0))
    blocks = explicit if explicit is not None else split_cpus(allowed, world_size)
    if blocks is None:
        torch.set_num_threads(1)
        if rank == 0:
            log.warning(
                "%d ranks on %d cores: ranks share cores, unpinned, one thread each",
                world_size,
                len(physical_cores(allowed)),
            )
        return None
    mine = blocks[rank]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(max(1, len(physical_cores(mine))))
    log.info("rank %d pinned to cpus %s, %d threads", rank, mine, torch.get_num_threads())
    return mine
