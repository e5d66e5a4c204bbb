"""A decode instance's KV fetch against producers that misbehave (a client names the
producer in kv_transfer_params): ``transfer_timeout`` bounds the whole fetch, not each
``recv``, and one slow producer does not hold up fetches from the others."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time

import torch

from aiolm.kv_transfer.config import parse_kv_transfer_config
from aiolm.kv_transfer.pd_worker import PDWorker


def _frame(obj: dict) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("<I", len(data)) + data


def _read_frame(conn: socket.socket) -> None:
    (n,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
    conn.recv(n, socket.MSG_WAITALL)


class FakeProducer:
    """A producer on 127.0.0.1: ``trickle`` sends its handshake answer a byte a second
    (a socket timeout of a second and more never trips); else it greets, then answers
    every fetch at once that the transfer is unknown."""

    def __init__(self, trickle: bool) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.trickle = trickle
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        with conn, contextlib.suppress(OSError, struct.error):  # the consumer hangs up at its end
            _read_frame(conn)
            hello = _frame({"ok": True, "machine": "elsewhere"})
            if self.trickle:
                for b in hello:
                    if self.stop.wait(1.0):
                        return
                    conn.sendall(bytes([b]))
                return
            conn.sendall(hello)
            while not self.stop.is_set():
                _read_frame(conn)
                conn.sendall(_frame({"ok": False, "error": "unknown or expired transfer"}))

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def test_a_trickling_producer_is_bounded_and_holds_up_no_other():
    cfg = parse_kv_transfer_config(
        json.dumps(
            {
                "kv_connector": "TcpConnector",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"transfer_timeout": 2, "shared_memory": False},
            }
        )
    )
    assert cfg is not None
    caches = [torch.zeros(2, 4, 16, 1, 8) for _ in range(2)]
    worker = PDWorker(cfg, 0, caches, {"model": "tiny"})
    slow, quick = FakeProducer(trickle=True), FakeProducer(trickle=False)
    try:
        t0 = time.monotonic()
        stuck = worker._fetcher.submit(worker._fetch, f"127.0.0.1:{slow.port}", "t-slow", [0, 1])
        time.sleep(0.2)  # the slow fetch holds a fetch thread first
        answered = worker._fetcher.submit(worker._fetch, f"127.0.0.1:{quick.port}", "t-quick", [2])
        assert answered.result(timeout=10).shape[2] == 0  # refused at once: no block
        assert time.monotonic() - t0 < 1.5  # it waited for no byte of the slow one
        assert stuck.result(timeout=10).shape[2] == 0  # cut off at the deadline: no block
        took = time.monotonic() - t0
        assert 1.5 < took < 4, took  # before: a byte a second kept it going for good
    finally:
        slow.close()
        quick.close()
        worker.close()


def test_a_release_ends_the_producers_lease_without_a_transfer():
    """A consumer that will not fetch a transfer (a local prefix hit held the prompt) asks
    for none of its blocks: the producer counts it sent at once, over shared memory or TCP
    (an empty fetch failed on both paths: a float index, a zero-length segment)."""
    import socket as _socket

    from aiolm.core.step import KVTransferOps

    for shared in (True, False):
        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = {"shared_memory": shared}
        producer_cfg = parse_kv_transfer_config(
            json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": port})
        )
        consumer_cfg = parse_kv_transfer_config(
            json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": extra})
        )
        assert producer_cfg is not None and consumer_cfg is not None
        caches = [torch.zeros(2, 4, 16, 1, 8) for _ in range(2)]
        producer = PDWorker(producer_cfg, 0, caches, {"model": "tiny"})
        consumer = PDWorker(consumer_cfg, 0, [c.clone() for c in caches], {"model": "tiny"})
        try:
            producer._apply(KVTransferOps(serve_ids=["t1"], serve_block_ids=[[1, 2]]))
            consumer._apply(KVTransferOps(release_sources=[f"127.0.0.1:{port}"], release_transfer_ids=["t1"]))
            deadline = time.monotonic() + 10
            while "t1" not in producer._sent_here and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "t1" in producer._sent_here, shared
            consumer._fetcher.shutdown(wait=True)  # its answer read before the connection is closed
        finally:
            consumer.close()
            producer.close()
