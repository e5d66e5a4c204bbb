"""The offloading connector's worker side: one rank's host tier, disk writer and loads.

A block leaves the cache as raw bytes, every layer's K and V of it: (layers, 2,
block_size, kv_heads, head_dim x element bytes), so fp8, float16 and float32 caches
move alike. Saves are copied out synchronously at the start of the step that evicted
them (before anything of the step writes the block); the disk write goes to a
background thread, which also deletes the files the index drops, in order. A block
being written stays readable from memory until its file is in place.

Loads read in another thread (host tier, then a pending write, then the file, checked
by block_files.read_block) from the start of the step that asked for them, and are
copied into their blocks at the start of the first step by which every rank has read
its share (rank_sync.py), as many blocks as the rank that found the fewest intact.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from aiolm.core.step import SchedulerOutput
from aiolm.kv_transfer.base import ConnectorWorker
from aiolm.kv_transfer.block_files import BlockFileError, file_name, rank_dir, read_block, write_block
from aiolm.kv_transfer.config import KVTransferConfig
from aiolm.kv_transfer.loads import PendingLoads, by_layer

log = logging.getLogger(__name__)


class OffloadWorker(ConnectorWorker):
    def __init__(self, config: KVTransferConfig, fingerprint: str, rank: int, kv_caches: list[torch.Tensor]) -> None:
        self.fingerprint = fingerprint
        self.rank = rank
        self.device = kv_caches[0].device
        # Byte views: (2, num_blocks, block_size, kv_heads, head_dim x element bytes) per layer.
        self.caches = [kv.view(torch.uint8) for kv in kv_caches]
        c = self.caches[0]
        self.block_shape = (len(self.caches), 2, *c.shape[2:])
        self.block_bytes = len(self.caches) * 2 * c[0, 0].numel()
        self.pin = self.device.type == "cuda"
        # The host tier: one slab of the tier's blocks, allocated once (pinned on CUDA), and
        # the free slots. A block kept as a view of its step's buffer kept the whole buffer
        # alive; one allocation per block pinned up to twice its bytes (power-of-two rounding).
        # The scheduler's cap, from the largest rank's block bytes, is never above the slots.
        slots = config.cpu_blocks(self.block_bytes) if (config.num_cpu_blocks or config.cpu_bytes) else 0
        self.host_on = slots > 0
        self._slab = torch.empty((slots, *self.block_shape), dtype=torch.uint8, pin_memory=self.pin and slots > 0)
        self._free_slots = list(range(slots - 1, -1, -1))
        self._slot_of: dict[bytes, int] = {}
        self.host: dict[bytes, torch.Tensor] = {}  # block hash -> its slot's view of the slab
        self.dir: Path | None = None
        if config.disk_path:
            self.dir = rank_dir(config.disk_path, fingerprint, rank)
            self.dir.mkdir(parents=True, exist_ok=True)
        self._writing: dict[bytes, torch.Tensor] = {}  # saved, file not in place yet
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="aiolm-kv-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="aiolm-kv-read")
        self.loads = PendingLoads(self.caches, self.device)

    # -- the step ------------------------------------------------------------------

    def begin_step(self, step: SchedulerOutput, idle: bool = False) -> None:
        self.loads.settle(wait=idle)
        ops = step.kv_ops
        if ops is None:
            return
        # Host drops free their slots for this step's saves: the scheduler never drops a hash
        # it saves in the same step, so the order between them is free here.
        for h in ops.drop_host:
            self._drop_host(h)
        if ops.save_block_ids:
            self._save(ops.save_block_ids, ops.save_hashes)
        if self.dir is not None:
            for h in ops.drop_disk:
                self._writer.submit(self._delete, h)
        for load_id, hashes, block_ids in zip(ops.load_ids, ops.load_hashes, ops.load_block_ids):
            self.loads.add(load_id, block_ids, self._reader.submit(self._read, hashes))

    def finished_loads(self) -> dict[int, int]:
        return self.loads.take_finished()

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)

    # -- saving ----------------------------------------------------------------------

    def _save(self, block_ids: list[int], hashes: list[bytes]) -> None:
        ids = torch.tensor(block_ids, device=self.device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=torch.uint8, pin_memory=self.pin)
        for layer, cache in enumerate(self.caches):
            out[:, layer].copy_(cache.index_select(1, ids).transpose(0, 1))
        for h, block in zip(hashes, out.unbind(0)):
            if self.host_on:
                self._keep_host(h, block)
            if self.dir is not None:
                with self._lock:
                    self._writing[h] = block
                self._writer.submit(self._write, h, block)

    def _keep_host(self, h: bytes, block: torch.Tensor) -> None:
        """Under the lock: the reader copies a slot out under it, never while it is refilled."""
        with self._lock:
            slot = self._slot_of.get(h)
            if slot is None:
                if not self._free_slots:  # the scheduler's cap is never above the slots: not reached
                    log.warning("KV offload: the host tier has no free slot for block %s", h.hex()[:16])
                    return
                slot = self._slot_of[h] = self._free_slots.pop()
            self.host[h] = self._slab[slot].copy_(block)

    def _drop_host(self, h: bytes) -> None:
        with self._lock:
            self.host.pop(h, None)
            slot = self._slot_of.pop(h, None)
            if slot is not None:
                self._free_slots.append(slot)

    def _write(self, h: bytes, block: torch.Tensor) -> None:
        assert self.dir is not None
        path, data = self.dir / file_name(h), block.reshape(-1).numpy().data
        try:
            try:
                write_block(path, self.fingerprint, h, data)
            except FileNotFoundError:  # its folder was deleted under the server: made again
                self.dir.mkdir(parents=True, exist_ok=True)
                write_block(path, self.fingerprint, h, data)
        except OSError as e:  # a full disk loses the block, never the step
            log.warning("KV offload: could not write block %s: %s", h.hex()[:16], e)
        finally:
            with self._lock:
                if self._writing.get(h) is block:
                    del self._writing[h]

    def _delete(self, h: bytes) -> None:
        assert self.dir is not None
        try:
            os.unlink(self.dir / file_name(h))
        except FileNotFoundError:
            pass

    # -- loading -----------------------------------------------------------------------

    def _read(self, hashes: list[bytes]) -> torch.Tensor:
        """The blocks named, from the first, up to the first that is missing or bad."""
        out = []
        for h in hashes:
            with self._lock:  # a host block is copied out of its slot, which a later step may refill
                block = self.host.get(h)
                block = block.clone() if block is not None else self._writing.get(h)
            if block is None and self.dir is not None:
                try:
                    payload = read_block(self.dir / file_name(h), self.fingerprint, h, self.block_bytes)
                except BlockFileError as e:
                    log.warning("KV offload: block %s is recomputed: %s", h.hex()[:16], e)
                    break
                block = torch.frombuffer(payload, dtype=torch.uint8).view(self.block_shape)
            if block is None:
                break
            out.append(block)
        return by_layer(out, self.block_shape)
