"""Tensor-parallel group and pipeline stage of the current process.

Model layers ask this module for their rank, world size and all-reduce, so the same
layer code runs with one rank (identity all-reduce) and with several; the model builder
asks it which pipeline stage this process runs (stages.py), and hands that to the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from aiolm.distributed.stages import PipelineStage


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    # Set by the worker when world_size > 1: shm, symm_mem, gloo or nccl (distributed/communicator.py).
    all_reduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    all_gather_fn: Callable[[torch.Tensor], torch.Tensor] | None = None  # concat on the last dim

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.all_reduce_fn is None:
            raise RuntimeError("tensor parallel group has no all-reduce configured")
        return self.all_reduce_fn(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.all_gather_fn is None:
            raise RuntimeError("tensor parallel group has no all-gather configured")
        return self.all_gather_fn(x)


_group = TPGroup()


def get_tp_group() -> TPGroup:
    return _group


def set_tp_group(group: TPGroup) -> None:
    global _group
    _group = group


_stage = PipelineStage()


def get_pp_stage() -> PipelineStage:
    return _stage


def set_pp_stage(stage: PipelineStage) -> None:
    global _stage
    _stage = stage
