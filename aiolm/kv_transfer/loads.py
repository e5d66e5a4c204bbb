"""A rank's KV loads in flight, put into their blocks once every rank has its share.

A load is a future (a reader or fetch thread's) that yields the blocks read, from the
first, as one byte tensor (layers, 2, blocks, block_size, kv_heads, head_dim x element
bytes), each layer's part laid out as the cache lays out that layer's blocks: fewer
blocks than asked when one was missing or bad. ``settle`` runs at the start of each step, on the
model runner's thread, so the KV cache is only ever written there, between forward
passes: the loads every rank has finished go into their blocks, cut to the fewest blocks
any rank read (rank_sync.py), and are reported; the rest keep moving.
"""

from __future__ import annotations

import logging
from concurrent import futures
from concurrent.futures import FIRST_COMPLETED, Future
from dataclasses import dataclass

import torch

from aiolm.kv_transfer.rank_sync import agree_min

log = logging.getLogger(__name__)

# A step with nothing to run waits this long for a load to finish, so an engine whose only
# work is loads steps at this pace instead of spinning.
IDLE_WAIT_S = 0.02


@dataclass
class _Load:
    block_ids: list[int]
    read: Future[torch.Tensor]


def by_layer(blocks: list[torch.Tensor], block_shape: tuple[int, ...]) -> torch.Tensor:
    """Blocks of (layers, 2, block_size, heads, head bytes) as one (layers, 2, blocks, ...) tensor."""
    if not blocks:
        layers, two, *rest = block_shape
        return torch.empty((layers, two, 0, *rest), dtype=torch.uint8)
    return torch.stack(blocks, dim=2)


class PendingLoads:
    def __init__(self, caches: list[torch.Tensor], device: torch.device) -> None:
        self.caches = caches  # byte views, (2, num_blocks, block_size, kv_heads, head bytes) per layer
        self.device = device
        self._loads: dict[int, _Load] = {}  # in the order they were asked for, the same on every rank
        self._finished: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._loads)

    def add(self, load_id: int, block_ids: list[int], read: Future[torch.Tensor]) -> None:
        self._loads[load_id] = _Load(block_ids, read)

    def take_finished(self) -> dict[int, int]:
        """Loads put into their blocks since the last call: load id -> intact blocks."""
        done, self._finished = self._finished, {}
        return done

    def settle(self, wait: bool = False) -> None:
        """Put every load all ranks have finished into its blocks; with ``wait``, first wait
        a little for one to finish (a step with nothing else to do)."""
        if not self._loads:
            return
        if wait and not any(load.read.done() for load in self._loads.values()):
            futures.wait([load.read for load in self._loads.values()], IDLE_WAIT_S, FIRST_COMPLETED)
        ids = list(self._loads)
        agreed = agree_min([self._count(self._loads[i]) for i in ids], self.device)
        for load_id, n in zip(ids, agreed):
            if n < 0:
                continue  # some rank still reads it
            load = self._loads.pop(load_id)
            if n:
                data = load.read.result()[:, :, :n].to(self.device)
                idx = torch.tensor(load.block_ids[:n], device=self.device)
                for layer, cache in enumerate(self.caches):
                    cache.index_copy_(1, idx, data[layer])
            self._finished[load_id] = n

    @staticmethod
    def _count(load: _Load) -> int:
        """-1 while reading; else the blocks read intact (0 when the reader failed)."""
        if not load.read.done():
            return -1
        try:
            return int(load.read.result().shape[2])
        except Exception as e:  # a reader that broke loses its load, never the step
            log.warning("KV load failed: %s: %s", type(e).__name__, e)
            return 0
