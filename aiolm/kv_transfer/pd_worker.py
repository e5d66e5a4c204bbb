"""The TcpConnector's worker side: a rank serves its finished prompts' KV to decode
instances, and fetches prompts' KV from prefill instances (wire.py has the protocol).

Producer: a listening socket on ``kv_ip:kv_port + rank`` and a thread per connection.
A transfer is served only between the step that registers it and the step that
unregisters it (sent, or its lease ended): its blocks are copied out under a lock that
unregistering also takes, so a block is never read after the scheduler may reuse it.
A transfer counts as sent once this rank sent it and, through rank_sync, every rank has.

Between ranks on one machine (their handshake says so) the bytes go through a
shared-memory segment instead of the socket (wire.py), unless ``shared_memory`` is off.

Consumer: loads run on one thread, one connection per producer rank kept open; a load
that fails in any way (refused handshake, broken connection, silence past
``transfer_timeout``, a bad checksum) yields no block, so the request computes its
prompt. Loads land through loads.PendingLoads, like the offloading connector's.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import select
import socket
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import posix_ipc
import torch

from aiolm.core.step import KVTransferOps, SchedulerOutput
from aiolm.ipc import segment
from aiolm.kv_transfer.base import ConnectorWorker
from aiolm.kv_transfer.config import KVTransferConfig
from aiolm.kv_transfer.loads import IDLE_WAIT_S, PendingLoads
from aiolm.kv_transfer.rank_sync import agree_min
from aiolm.kv_transfer.wire import (
    WireError,
    layout_difference,
    machine_id,
    recv_buffer,
    recv_json,
    send_buffer,
    send_json,
)

log = logging.getLogger(__name__)

# Test-only fault injection on a producer: with AIOLM_TEST_KV_SEND_FAULT=<path>, each
# transfer reads the file: "stall:<seconds>" sleeps halfway through it (a test kills the
# instance then), "corrupt" damages a layer's bytes after its checksum was taken.
FAULT_ENV = "AIOLM_TEST_KV_SEND_FAULT"
FETCH_THREADS = 4  # producers fetched from at once
MAX_PEERS = 256  # producers a worker keeps a lock and a connection for


class PDWorker(ConnectorWorker):
    def __init__(
        self, config: KVTransferConfig, rank: int, kv_caches: list[torch.Tensor], layout: dict[str, Any]
    ) -> None:
        self.cfg = config
        self.rank = rank
        self.device = kv_caches[0].device
        self.caches = [kv.view(torch.uint8) for kv in kv_caches]  # (2, blocks, block_size, heads, head bytes)
        self.layout = dict(layout, rank=rank)
        self.loads = PendingLoads(self.caches, self.device)
        self._lock = threading.Lock()
        self._serving: dict[str, list[int]] = {}  # registered, in order (the same on every rank)
        self._sent_here: set[str] = set()  # sent by this rank
        self._reported: set[str] = set()  # sent by every rank, reported, not yet unregistered
        self._sent_event = threading.Event()
        self._sent_all: list[str] = []
        self._closed = False
        self._fault_path = os.environ.get(FAULT_ENV)
        self._server: socket.socket | None = None
        if config.produces:
            self._server = socket.create_server((config.kv_ip, config.kv_port + rank), reuse_port=False)
            threading.Thread(target=self._accept, name=f"aiolm-kv-serve{rank}", daemon=True).start()
        # Fetches from different producers run side by side, so one slow or silent peer
        # (a client names it) delays only the loads it serves; one at a time per producer,
        # on the connection kept for it.
        self._fetcher = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="aiolm-kv-fetch")
        self._conns: dict[str, socket.socket] = {}  # producer host:port -> connection (under its lock)
        self._shm: dict[str, bool] = {}  # producer host:port -> on this machine: fetch through shared memory
        # producer host:port -> held while fetching from it (_peer_lock)
        self._peer_locks: dict[str, threading.Lock] = {}
        self._peers_lock = threading.Lock()  # guards the three maps above
        self.machine = machine_id()

    # -- the step ------------------------------------------------------------------

    def begin_step(self, step: SchedulerOutput, idle: bool = False) -> None:
        if idle and self._serving and not self.loads and not self._sent_here:
            self._sent_event.wait(IDLE_WAIT_S)  # nothing to run but a consumer to wait for
        self.loads.settle(wait=idle)
        self._settle_sends()
        ops = step.kv_ops
        if ops is not None:
            self._apply(ops)

    def finished_loads(self) -> dict[int, int]:
        return self.loads.take_finished()

    def finished_sends(self) -> list[str]:
        done, self._sent_all = self._sent_all, []
        return done

    def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        with self._peers_lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()

    def _apply(self, ops: KVTransferOps) -> None:
        with self._lock:
            for transfer_id, block_ids in zip(ops.serve_ids, ops.serve_block_ids):
                self._serving[transfer_id] = block_ids
            for transfer_id in ops.unserve_ids:
                self._serving.pop(transfer_id, None)
                self._sent_here.discard(transfer_id)
                self._reported.discard(transfer_id)
        for load_id, source, transfer_id, remote_ids, block_ids in zip(
            ops.load_ids, ops.load_sources, ops.load_transfer_ids, ops.load_remote_block_ids, ops.load_block_ids
        ):
            read = self._fetcher.submit(self._fetch, source, transfer_id, remote_ids)
            self.loads.add(load_id, block_ids, read)
        for source, transfer_id in zip(ops.release_sources, ops.release_transfer_ids):
            self._fetcher.submit(self._fetch, source, transfer_id, [])  # none of its blocks: it ends the lease

    def _settle_sends(self) -> None:
        """Report the transfers every rank has sent (once each)."""
        with self._lock:
            order = [t for t in self._serving if t not in self._reported]
            mine = [1 if t in self._sent_here else 0 for t in order]
        if not order:
            return
        for transfer_id, sent in zip(order, agree_min(mine, self.device)):
            if sent:
                self._reported.add(transfer_id)
                self._sent_all.append(transfer_id)
        self._sent_event.clear()

    # -- producer ------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._server is not None
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="aiolm-kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.cfg.transfer_timeout)
            try:
                hello = recv_json(conn)
                why = layout_difference(self.layout, hello.get("layout") or {})
                if why is not None:
                    send_json(conn, {"ok": False, "error": f"KV layouts differ: {why}"})
                    return
                send_json(conn, {"ok": True, "machine": self.machine})
                conn.settimeout(None)  # a kept connection waits for the next fetch as long as it likes
                while True:
                    self._serve_fetch(conn, recv_json(conn))
            except (WireError, OSError):
                return

    def _serve_fetch(self, conn: socket.socket, ask: dict[str, Any]) -> None:
        transfer_id = str(ask.get("transfer"))
        blocks = ask.get("blocks")
        with self._lock:
            held = self._serving.get(transfer_id)
            if held is None or not isinstance(blocks, list) or not set(blocks) <= set(held):
                error = "unknown or expired transfer" if held is None else "blocks not of this transfer"
                send_json(conn, {"ok": False, "error": error})
                return
            if not blocks:  # the consumer will not fetch it (a release): the lease ends now
                self._sent_here.add(transfer_id)
            else:
                idx = torch.tensor(blocks, device=self.device)
                # Copied while no step can reuse them: unregistering waits for this lock.
                layers = [c.index_select(1, idx).cpu() for c in self.caches]
        if not blocks:
            send_json(conn, {"ok": True, "layers": len(self.caches)})
            self._sent_event.set()
            return
        fault = self._fault()
        if ask.get("shm"):
            self._send_shm(conn, str(ask["shm"]), layers, fault)
        else:
            self._send_tcp(conn, layers, fault)
        with self._lock:
            if transfer_id in self._serving:
                self._sent_here.add(transfer_id)
        self._sent_event.set()

    def _fault(self) -> str:
        if self._fault_path is None:
            return ""
        try:
            with open(self._fault_path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def _send_tcp(self, conn: socket.socket, layers: list[torch.Tensor], fault: str) -> None:
        send_json(conn, {"ok": True, "layers": len(layers)})
        for i, layer in enumerate(layers):
            data = layer.reshape(-1).numpy().data
            if not fault or i != len(layers) // 2:
                send_buffer(conn, data)
            elif fault.startswith("stall:"):
                time.sleep(float(fault.removeprefix("stall:")))
                send_buffer(conn, data)
            else:
                damaged = bytearray(data)
                damaged[len(damaged) // 2] ^= 0xFF
                send_buffer(conn, memoryview(damaged), zlib.crc32(data))

    def _send_shm(self, conn: socket.socket, name: str, layers: list[torch.Tensor], fault: str) -> None:
        """The layers into the consumer's shared-memory segment ``name``, one after another."""
        total = sum(layer.numel() for layer in layers)
        try:
            mm = segment.attach(name)
        except (ValueError, OSError, posix_ipc.Error) as e:
            send_json(conn, {"ok": False, "error": f"cannot map the consumer's segment: {e}"})
            return
        try:
            if len(mm) < total:
                send_json(conn, {"ok": False, "error": "the consumer's segment is too small"})
                return
            buf = torch.frombuffer(mm, dtype=torch.uint8, count=total)
            crcs, off = [], 0
            for layer in layers:
                part = buf[off : off + layer.numel()]
                part.copy_(layer.reshape(-1))
                crcs.append(zlib.crc32(part.numpy().data))
                off += layer.numel()
            if fault.startswith("stall:"):
                time.sleep(float(fault.removeprefix("stall:")))
            elif fault == "corrupt":
                buf[total // 2] ^= 0xFF
            del buf, part
        finally:
            _close(mm)
        send_json(conn, {"ok": True, "layers": len(layers), "crcs": crcs})

    # -- consumer --------------------------------------------------------------------

    def _fetch(self, source: str, transfer_id: str, remote_ids: list[int]) -> torch.Tensor:
        """The blocks of ``transfer_id`` from this rank's producer peer, as one (layers, 2,
        blocks, block_size, heads, head bytes) byte tensor; no block when anything goes wrong,
        or when the whole fetch, its wait for the producer's other fetches included, takes
        longer than ``transfer_timeout``."""
        deadline = time.monotonic() + self.cfg.transfer_timeout
        lock = self._peer_lock(source, deadline)
        if lock is None:
            log.warning("KV fetch of %s from %s: no turn at the producer within the timeout", transfer_id, source)
            c = self.caches[0]
            return torch.empty((len(self.caches), 2, 0, *c.shape[2:]), dtype=torch.uint8)
        try:
            return self._fetch_from(source, transfer_id, remote_ids, deadline)
        finally:
            lock.release()

    def _peer_lock(self, source: str, deadline: float) -> threading.Lock | None:
        """``source``'s lock, acquired by the deadline (None: not in time, or too many
        producers busy). Clients name producers, so the map is bounded: an idle producer's
        entry makes room, and a lock taken from the map is used only while still its entry."""
        while True:
            with self._peers_lock:
                lock = self._peer_locks.get(source)
                if lock is None:
                    if len(self._peer_locks) >= MAX_PEERS:
                        self._forget_an_idle_peer()
                    if len(self._peer_locks) >= MAX_PEERS:
                        return None
                    lock = self._peer_locks[source] = threading.Lock()
            left = deadline - time.monotonic()
            if left <= 0 or not lock.acquire(timeout=left):
                return None
            with self._peers_lock:
                if self._peer_locks.get(source) is lock:
                    return lock
            lock.release()  # its entry was forgotten meanwhile: take the new one

    def _forget_an_idle_peer(self) -> None:
        """Drop one producer nobody is fetching from, and its connection (``_peers_lock`` held)."""
        for known, lock in list(self._peer_locks.items()):
            if lock.acquire(blocking=False):
                try:
                    del self._peer_locks[known]
                    self._shm.pop(known, None)
                    conn = self._conns.pop(known, None)
                    if conn is not None:
                        conn.close()
                finally:
                    lock.release()
                return

    def _fetch_from(self, source: str, transfer_id: str, remote_ids: list[int], deadline: float) -> torch.Tensor:
        c = self.caches[0]
        out = torch.empty((len(self.caches), 2, len(remote_ids), *c.shape[2:]), dtype=torch.uint8)
        shm: tuple[str, mmap.mmap, Callable[[], bool]] | None = None
        try:
            conn = self._connect(source, deadline)
            conn.settimeout(max(0.001, deadline - time.monotonic()))  # a kept one has the last fetch's
            if self._shm[source] and remote_ids:
                shm = segment.create(max(1, out.numel()))
            send_json(conn, {"transfer": transfer_id, "blocks": remote_ids, "shm": shm[0] if shm else None})
            answer = recv_json(conn, deadline)
            if not remote_ids:  # a release: one the producer no longer serves (its lease ran out) is done too
                return out
            if not answer.get("ok"):
                raise WireError(str(answer.get("error")))
            if answer.get("layers") != len(self.caches):
                raise WireError(f"{answer.get('layers')} layers sent, {len(self.caches)} here")
            if shm is not None:
                _copy_checked(shm[1], answer.get("crcs") or [], out)
            else:
                for layer in out:  # each layer's frame lands where the cache's layout wants it
                    recv_buffer(conn, layer.view(-1).numpy().data, deadline)
            return out
        except (WireError, OSError) as e:
            self._drop(source)
            log.warning("KV fetch of %s from %s failed (rank %d): %s", transfer_id, source, self.rank, e)
            return out[:, :, :0]
        finally:
            if shm is not None:
                name, mm, hook = shm
                segment.unlink(name)
                atexit.unregister(hook)
                _close(mm)

    def _connect(self, source: str, deadline: float) -> socket.socket:
        """The kept connection to ``source`` (its lock held), made and greeted if need be."""
        self._sweep(source)
        with self._peers_lock:
            conn = self._conns.get(source)
        if conn is not None:
            return conn
        host, _, port = source.rpartition(":")
        conn = socket.create_connection((host, int(port) + self.rank), timeout=self.cfg.transfer_timeout)
        try:
            send_json(conn, {"layout": self.layout, "machine": self.machine})
            answer = recv_json(conn, deadline)
        except BaseException:
            conn.close()
            raise
        if not answer.get("ok"):
            conn.close()
            raise WireError(f"the prefill instance refused: {answer.get('error')}")
        with self._peers_lock:
            self._conns[source] = conn
            self._shm[source] = self.cfg.shared_memory and answer.get("machine") == self.machine
        return conn

    def _sweep(self, source: str) -> None:
        """Close the kept connections of producers that stopped (``source``'s, whose lock the
        caller holds, and any other not in use now)."""
        with self._peers_lock:
            kept = list(self._conns.items())
        for known, conn in kept:
            if known == source:
                if not _open(conn):
                    self._drop(known)
                continue
            with self._peers_lock:
                lock = self._peer_locks.get(known)
            if lock is not None and lock.acquire(blocking=False):
                try:
                    with self._peers_lock:
                        now = self._conns.get(known)  # the one kept now, not the snapshot's
                    if now is not None and not _open(now):
                        self._drop(known)
                finally:
                    lock.release()

    def _drop(self, source: str) -> None:
        with self._peers_lock:
            conn = self._conns.pop(source, None)
            self._shm.pop(source, None)
        if conn is not None:
            conn.close()


def _open(conn: socket.socket) -> bool:
    """Whether the peer still holds the connection (it sends nothing unasked, so any byte
    or end of stream waiting means it closed or broke the protocol)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable  # readable: end of stream, or bytes nobody asked for


def _close(mm: mmap.mmap) -> None:
    """Unmap, unless a tensor still views it (the mapping then goes with the last view)."""
    try:
        mm.close()
    except BufferError:
        pass


def _copy_checked(mm: mmap.mmap, crcs: list[int], out: torch.Tensor) -> None:
    """``out``'s layers from the segment, one after another, each checked against its CRC-32."""
    if len(crcs) != len(out):
        raise WireError(f"{len(crcs)} checksums for {len(out)} layers")
    src = torch.frombuffer(mm, dtype=torch.uint8, count=out.numel())
    off = 0
    for layer, crc in zip(out, crcs):
        flat = layer.view(-1)
        flat.copy_(src[off : off + flat.numel()])
        off += flat.numel()
        if zlib.crc32(flat.numpy().data) != crc:
            raise WireError("a KV frame failed its checksum")
