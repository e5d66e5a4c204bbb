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
        self.host_on = bool(config.num_cpu_blocks or config.cpu_bytes)
        self.host: dict[bytes, torch.Tensor] = {}
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
        if ops.save_block_ids:
            self._save(ops.save_block_ids, ops.save_hashes)
        for h in ops.drop_host:
            self.host.pop(h, None)
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
                # storage of its own: a view would keep the whole step's buffer alive while
                # any one of its blocks stays, and the tier's cap would count blocks, not bytes
                self.host[h] = torch.empty_like(block, pin_memory=self.pin).copy_(block)
            if self.dir is not None:
                with self._lock:
                    self._writing[h] = block
                self._writer.submit(self._write, h, block)

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
            block = self.host.get(h)
            if block is None:
                with self._lock:
                    block = self._writing.get(h)
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
