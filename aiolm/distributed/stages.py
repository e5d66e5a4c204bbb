"""Pipeline stages: which part of a model one stage runs (no process-wide state: the
current process's stage is in parallel_state.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    """Which part of the model this process runs: stage ``rank`` of ``size`` (one: all of it).
    The first stage embeds the tokens, the last holds the final norm and the LM head."""

    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        """This stage's decoder layers: an even split, the first ``num_layers % size`` stages
        one more each (the last stage also runs the LM head)."""
        return stage_layers(num_layers, self.rank, self.size)


def stage_layers(num_layers: int, rank: int, size: int) -> range:
    if not 0 <= rank < size or num_layers < size:
        raise ValueError(f"{num_layers} layers cannot be split into {size} pipeline stages (stage {rank})")
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def answering_rank(world_size: int, pipeline_size: int) -> int:
    """The rank that answers the engine's steps (ranks numbered stage by stage): the first rank
    of the last stage, which samples."""
    return world_size - world_size // pipeline_size
