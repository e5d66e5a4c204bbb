"""The offloading connector's scheduler side: which evicted blocks the tiers keep.

Blocks that hold a cached prefix are saved when the pool evicts them (write on
eviction: a block that is reused while still cached costs no write), into the host
tier (worker memory, pinned on CUDA) and, when there is one, the disk tier (written
through, in the background). Each tier is an LRU of block hashes with a cap in
blocks; this index is the one authority on what the tiers hold, and the workers
follow its saves and drops in step order. A later prefix lookup that runs past the
pool's cached blocks continues here, and the blocks found are loaded instead of
computed.

The host index is lost with the workers; the disk index is rebuilt from the
directory when an engine starts, so prefixes outlive restarts. A disk entry whose
file never landed (a worker died before its write) is found missing at load time
and recomputed like a corrupt one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from aiolm.core.request import Request
from aiolm.core.step import KVTransferOps
from aiolm.kv_transfer.base import ConnectorScheduler


class OffloadScheduler(ConnectorScheduler):
    def __init__(self, host_blocks: int, disk_blocks: int, on_disk: Sequence[bytes] = ()) -> None:
        super().__init__()
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.disk: OrderedDict[bytes, None] = OrderedDict((h, None) for h in on_disk) if disk_blocks else OrderedDict()
        self._trim(self.disk, self.disk_blocks, self._ops.drop_disk)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.host or block_hash in self.disk

    def num_external_blocks(self, request: Request, start: int, limit: int) -> int:
        hashes = request.block_hashes
        n = 0
        for i in range(start, min(limit, len(hashes))):
            h = hashes[i]
            if h not in self:
                break
            self._touch(h)
            n += 1
        return n

    def start_load(self, load_id: int, request: Request, start: int, block_ids: Sequence[int]) -> None:
        ops = self._ops
        ops.load_ids.append(load_id)
        ops.load_req_ids.append(request.req_id)
        ops.load_hashes.append(request.block_hashes[start : start + len(block_ids)])
        ops.load_block_ids.append(list(block_ids))

    def loaded(self, request: Request, start: int, asked: int, intact: int) -> None:
        self.stats.loaded_blocks += intact
        if intact < asked:
            self.stats.failed_loads += 1
            self.stats.failed_blocks += asked - intact
            bad = request.block_hashes[start + intact]
            # Forget it everywhere: a later lookup stops before it and computes it.
            for tier, drops in ((self.host, self._ops.drop_host), (self.disk, self._ops.drop_disk)):
                if bad in tier:
                    del tier[bad]
                    drops.append(bad)

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        if block_hash in self:
            self._touch(block_hash)
            return
        ops = self._ops
        ops.save_block_ids.append(block_id)
        ops.save_hashes.append(block_hash)
        self.stats.saved_blocks += 1
        # Workers save before they drop: a hash trimmed earlier in this step and saved
        # again must not be dropped after its new save.
        for drops in (ops.drop_host, ops.drop_disk):
            if block_hash in drops:
                drops.remove(block_hash)
        if self.host_blocks:
            self.host[block_hash] = None
            self._trim(self.host, self.host_blocks, ops.drop_host)
        if self.disk_blocks:
            self.disk[block_hash] = None
            self._trim(self.disk, self.disk_blocks, ops.drop_disk)

    def reset(self) -> None:
        self.host.clear()
        self._ops = KVTransferOps()

    def _touch(self, block_hash: bytes) -> None:
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
        if block_hash in self.disk:
            self.disk.move_to_end(block_hash)

    def _trim(self, tier: OrderedDict[bytes, None], cap: int, drops: list[bytes]) -> None:
        """Drop the least recently used entries past ``cap``; a block leaving the last tier
        that holds it is gone."""
        while len(tier) > cap:
            h, _ = tier.popitem(last=False)
            drops.append(h)
            if h not in self:
                self.stats.dropped_blocks += 1
