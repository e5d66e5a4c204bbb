"""Which data-parallel replica serves a request: prefix-cache affinity, bounded by load.

Each replica has its own prefix cache, so a prompt that shares its first blocks
with an earlier one is cheapest on the replica that served the earlier one. The
router keeps chained hashes of the first ``max_blocks`` full blocks of every
routed prompt (the same block boundaries as the KV cache), each mapped to the
replica it went to, in a bounded LRU table. A new prompt goes to the replica of
its longest known prefix, unless that replica is unavailable or has more than
``slack`` live sequences beyond the least loaded one; then it goes to the least
loaded replica (ties in turn). Pure Python, no engine state: the caller passes
the loads.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field


@dataclass
class RouteStats:
    routed: list[int] = field(default_factory=list)  # requests per replica
    affinity: list[int] = field(default_factory=list)  # of which went by a known prefix


@dataclass(frozen=True)
class Route:
    replica: int
    affinity: bool  # chosen by a known prefix


class PrefixRouter:
    def __init__(
        self, num_replicas: int, block_size: int, max_blocks: int = 8, slack: int = 8, capacity: int = 1 << 16
    ) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.slack = slack
        self.capacity = capacity
        self._table: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._turn = itertools.count()
        self.stats = RouteStats([0] * num_replicas, [0] * num_replicas)

    def prefix_hashes(self, token_ids: list[int]) -> list[int]:
        """Chained hashes of the first full blocks (hashes of int tuples do not vary between runs)."""
        hashes, h = [], 0
        n = min(len(token_ids) // self.block_size, self.max_blocks)
        for i in range(n):
            h = hash((h, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])))
            hashes.append(h)
        return hashes

    def choose(self, token_ids: list[int], loads: list[int | None]) -> int:
        """The replica for this prompt, recorded as routed there (``pick`` then ``record``)."""
        route = self.pick(token_ids, loads)
        self.record(route)
        return route.replica

    def pick(self, token_ids: list[int], loads: list[int | None]) -> Route:
        """The replica for this prompt; ``loads[i]`` is replica i's live sequences, None when it
        cannot take requests. Maps the prompt's prefix there at once (requests sharing it that
        arrive before the replica answers follow it); counts nothing, as the replica may still
        refuse. ValueError when no replica is available."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise ValueError("no replica is available")
        least = min(loads[i] for i in live)  # type: ignore[type-var]
        hashes = self.prefix_hashes(token_ids)
        route = None
        for h in reversed(hashes):
            i = self._table.get(h)
            if i is not None and loads[i] is not None and loads[i] <= least + self.slack:  # type: ignore[operator]
                route = Route(i, True)
                break
        if route is None:
            tied = [i for i in live if loads[i] == least]
            route = Route(tied[next(self._turn) % len(tied)], False)
        for h in hashes:
            self._table[h] = route.replica
            self._table.move_to_end(h)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)
        return route

    def record(self, route: Route) -> None:
        """The request was added where ``route`` says: count it there."""
        self.stats.routed[route.replica] += 1
        if route.affinity:
            self.stats.affinity[route.replica] += 1
