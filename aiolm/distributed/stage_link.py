"""The link between two pipeline stages: one step's activations, handed on in step order.

Stage s's rank t sends the output of its last layer and the residual stream to stage s+1's
rank t (the same slice of the tensor-parallel group: every rank of a stage holds the whole
hidden state after its all-reduce). On one machine the link is a shared-memory ring
(aiolm/ipc/shm_ring.py) that the engine creates and owns, so a SIGKILLed stage leaves no
segment behind and the stage after it sees ``PeerDied`` rather than waiting forever.

Between machines (stages placed on several nodes by the Ray executor) the same messages
go over one TCP connection per rank pair (``TcpChannel``): the receiving rank listens, the
sending rank connects, and each message is one frame. A peer that dies
closes or resets the connection, which the reader sees as ``PeerDied``. Frames are the
KV connector's (aiolm/kv_transfer/wire.py: a length, then the bytes).

A message is a 40-byte header (step, tokens, hidden size, the two dtypes) and the two
tensors' bytes, each in its own dtype (a bfloat16 model on a CPU adds float32 residuals).
The receiver checks the step: stages run steps in the order the engine sent them, so a
mismatch is a bug, never a reordering to tolerate.
"""

from __future__ import annotations

import select
import socket
import struct
from typing import Protocol

import torch

from aiolm.ipc.shm_ring import PeerDied
from aiolm.kv_transfer.wire import WireError, recv_exact, recv_frame_len, send_frame

_HEADER = struct.Struct("<QQQQQ")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Channel(Protocol):
    """One direction of a link: a shared-memory ring (aiolm/ipc/shm_ring.py) or a TcpChannel."""

    def write(self, data: memoryview) -> None: ...
    def read(self, timeout: float | None = None) -> bytes: ...
    def close(self) -> None: ...


class TcpChannel:
    """A link's direction over TCP: ``write`` and ``read`` as a ring's, one message at a time."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)  # blocking: a long prompt step on the next stage is no failure
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished node ends the link
        self.sock = sock
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)

    @staticmethod
    def listen() -> tuple[socket.socket, int]:
        """A listening socket on every interface of this node, and its port."""
        listener = socket.create_server(("", 0))
        return listener, int(listener.getsockname()[1])

    @classmethod
    def accept(cls, listener: socket.socket, timeout_s: float) -> TcpChannel:
        listener.settimeout(timeout_s)
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            raise PeerDied(f"the previous pipeline stage did not connect within {timeout_s:g} s") from None
        finally:
            listener.close()
        return cls(sock)

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> TcpChannel:
        return cls(socket.create_connection((host, port), timeout=timeout_s))

    def write(self, data: memoryview) -> None:
        try:
            send_frame(self.sock, data)
        except OSError as e:
            raise PeerDied(f"the next pipeline stage is gone: {e}") from e

    def read(self, timeout: float | None = None) -> bytes:
        if not self.poller.poll(None if timeout is None else timeout * 1000):
            raise TimeoutError
        try:
            return bytes(recv_exact(self.sock, recv_frame_len(self.sock)))
        except WireError as e:
            raise PeerDied(f"the link from the previous pipeline stage: {e}") from e

    def close(self) -> None:
        self.sock.close()


class StageLink:
    """This rank's ends: the channel from the stage before it (None on the first stage) and
    the channel to the stage after it (None on the last)."""

    def __init__(self, recv: Channel | None, send: Channel | None, timeout_s: float = 1.0) -> None:
        self.recv_from = recv
        self.send_to = send
        self.timeout_s = timeout_s  # a slice of waiting, after which the peer's life is checked

    def send(self, step: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.send_to is not None, "the last stage sends nothing on"
        t, h = hidden.shape
        head = _HEADER.pack(step, t, h, _DTYPES.index(hidden.dtype), _DTYPES.index(residual.dtype))
        parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
        parts += [x.detach().contiguous().cpu().view(torch.uint8).reshape(-1) for x in (hidden, residual)]
        self.send_to.write(memoryview(torch.cat(parts).numpy()))

    def recv(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s (hidden, residual) from the stage before, on ``device``; waits as long
        as that stage computes (its death ends the wait with PeerDied)."""
        assert self.recv_from is not None, "the first stage receives nothing"
        while True:
            try:
                buf = self.recv_from.read(timeout=self.timeout_s)
                break
            except TimeoutError:
                continue
        got, t, h, code_h, code_r = _HEADER.unpack_from(buf)
        if got != step:
            raise RuntimeError(f"pipeline stage link: step {got} arrived while running step {step}")
        data = bytearray(memoryview(buf)[_HEADER.size :])
        split = t * h * _DTYPES[code_h].itemsize
        hidden = torch.frombuffer(data, dtype=_DTYPES[code_h], count=t * h).view(t, h)
        residual = torch.frombuffer(data, dtype=_DTYPES[code_r], offset=split).view(t, h)
        return hidden.to(device), residual.to(device)

    def close(self) -> None:
        for ring in (self.recv_from, self.send_to):
            if ring is not None:
                ring.close()
