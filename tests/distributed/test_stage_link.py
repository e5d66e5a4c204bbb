"""The link between pipeline stages, over both of its channels: a shared-memory ring that
neither end created (as the engine makes them) and a TCP connection (stages on two nodes)."""

from __future__ import annotations

import threading

import pytest
import torch

from aiolm.distributed.stage_link import StageLink, TcpChannel
from aiolm.ipc.shm_ring import PeerDied, ShmRing


def _tensors(t: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(t, h, generator=g).to(torch.bfloat16), torch.randn(t, h, generator=g)


def test_a_ring_made_by_a_third_process_carries_steps_bit_for_bit():
    handle = ShmRing.create_between(num_readers=1, num_slots=4, slot_size=1 << 16)
    try:
        sender = StageLink(None, ShmRing.attach(handle, reader_rank=None))
        receiver = StageLink(ShmRing.attach(handle, reader_rank=0), None)
        for step, t in ((1, 3), (2, 2048)):  # a decode step, and a prompt chunk larger than the ring
            hidden, residual = _tensors(t, 576)
            done = threading.Thread(target=sender.send, args=(step, hidden, residual))
            done.start()
            got_h, got_r = receiver.recv(step, torch.device("cpu"))
            done.join()
            assert got_h.dtype == torch.bfloat16 and got_r.dtype == torch.float32
            assert torch.equal(got_h, hidden) and torch.equal(got_r, residual)
        sender.send(4, *_tensors(1, 8))
        with pytest.raises(RuntimeError, match="step 4 arrived while running step 3"):
            receiver.recv(3, torch.device("cpu"))
        sender.close()
        receiver.close()
    finally:
        assert handle.unlink()


def test_tcp_frames_messages_and_a_closed_peer_is_peer_died():
    listener, port = TcpChannel.listen()
    accepted: list[TcpChannel] = []
    waiter = threading.Thread(target=lambda: accepted.append(TcpChannel.accept(listener, 10.0)))
    waiter.start()
    sending = TcpChannel.connect("127.0.0.1", port, timeout_s=10.0)
    waiter.join()
    (receiving,) = accepted
    assert sending.sock.gettimeout() is None  # a long step on the next stage is no failure
    with pytest.raises(TimeoutError):
        receiving.read(timeout=0.05)
    sender, receiver = StageLink(None, sending), StageLink(receiving, None)
    hidden, residual = _tensors(700, 576)  # 2.4 MB: more than one socket buffer
    done = threading.Thread(target=sender.send, args=(7, hidden, residual))
    done.start()
    got_h, got_r = receiver.recv(7, torch.device("cpu"))
    done.join()
    assert torch.equal(got_h, hidden) and torch.equal(got_r, residual)
    sending.close()
    with pytest.raises(PeerDied, match="the peer closed the connection"):
        receiver.recv(8, torch.device("cpu"))
    receiving.close()


def test_nobody_connecting_ends_the_wait():
    listener, _ = TcpChannel.listen()
    with pytest.raises(PeerDied, match="did not connect within"):
        TcpChannel.accept(listener, 0.1)
