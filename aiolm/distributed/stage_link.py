"""The link between two pipeline stages: one step's activations, handed on in step order.

Stage s's rank t sends the output of its last layer and the residual stream to stage s+1's
rank t (the same slice of the tensor-parallel group: every rank of a stage holds the whole
hidden state after its all-reduce). On one machine the link is a shared-memory ring
(aiolm/ipc/shm_ring.py) that the engine creates and owns, so a SIGKILLed stage leaves no
segment behind and the stage after it sees ``PeerDied`` rather than waiting forever.

A message is a 40-byte header (step, tokens, hidden size, the two dtypes) and the two
tensors' bytes, each in its own dtype (a bfloat16 model on a CPU adds float32 residuals).
The receiver checks the step: stages run steps in the order the engine sent them, so a
mismatch is a bug, never a reordering to tolerate.
"""

from __future__ import annotations

import struct

import torch

from aiolm.ipc.shm_ring import ShmRing

_HEADER = struct.Struct("<QQQQQ")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class StageLink:
    """This rank's ends: the ring from the stage before it (None on the first stage) and the
    ring to the stage after it (None on the last)."""

    def __init__(self, recv: ShmRing | None, send: ShmRing | None, timeout_s: float = 1.0) -> None:
        self.recv_ring = recv
        self.send_ring = send
        self.timeout_s = timeout_s  # a slice of waiting, after which the peer's life is checked

    def send(self, step: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.send_ring is not None, "the last stage sends nothing on"
        t, h = hidden.shape
        head = _HEADER.pack(step, t, h, _DTYPES.index(hidden.dtype), _DTYPES.index(residual.dtype))
        parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
        parts += [x.detach().contiguous().cpu().view(torch.uint8).reshape(-1) for x in (hidden, residual)]
        self.send_ring.write(memoryview(torch.cat(parts).numpy()))

    def recv(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s (hidden, residual) from the stage before, on ``device``; waits as long
        as that stage computes (its death ends the wait with PeerDied)."""
        assert self.recv_ring is not None, "the first stage receives nothing"
        while True:
            try:
                buf = self.recv_ring.read(timeout=self.timeout_s)
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
        for ring in (self.recv_ring, self.send_ring):
            if ring is not None:
                ring.close()
