"""Cross-process wakeups and liveness checks for the shared-memory ring.

Why abstract Unix datagram sockets: a sleeping reader needs a file descriptor
that a writer in *another, unrelated* process can make readable, that an asyncio
loop can watch with ``add_reader`` and that a worker can ``poll`` with a timeout.
A socket bound in Linux's abstract namespace gives all three, and the kernel
removes the name the moment the last descriptor closes, so nothing is ever left
behind -- not even after SIGKILL. No descriptor has to be inherited, so it works
whichever side spawned the other. A poke is a one-byte datagram; a full queue
(``EAGAIN``) means the sleeper is already due to wake and the poke is dropped.
Only the ring's data lives in a 0600 shared-memory segment; a stray datagram
from elsewhere can do no more than cause a spurious re-check.
"""

from __future__ import annotations

import os
import select
import socket

_POKE = b"\x01"


def wake_address(ring_name: str, role: str) -> str:
    """Abstract-namespace address of one ring participant (``"w"`` or ``"r<rank>"``)."""
    return f"\0{ring_name}.{role}"


class WakeChannel:
    """The receiving end: a bound, non-blocking datagram socket others poke."""

    def __init__(self, address: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(address)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)

    def fileno(self) -> int:
        return self._sock.fileno()

    def wait(self, timeout: float | None) -> bool:
        """Sleep until poked or ``timeout`` seconds pass; True when poked."""
        ms = None if timeout is None else max(0, int(timeout * 1000.0 + 0.999))
        try:
            return bool(self._poll.poll(ms))
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            return False

    def drain(self) -> None:
        """Swallow pending pokes so the next wait sleeps again."""
        recv = self._sock.recv
        try:
            while True:
                recv(64)
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        self._sock.close()


class Poker:
    """The sending end: one unbound socket reused for every poke."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def poke(self, address: str) -> None:
        """Best effort: a missing peer or a full queue is not an error here."""
        try:
            self._sock.sendto(_POKE, address)
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a dead child not yet reaped)."""
    if pid <= 0:
        return True  # unknown peer: cannot judge, assume alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")
