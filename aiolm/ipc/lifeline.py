"""Keep a worker tied to its parent: notice its death, exit, and clean up.

Why polling first: a worker blocks in ``ShmRing.read(timeout=...)`` anyway, so
comparing ``os.getppid()`` with the pid its parent put on the command line after
each timeout costs nothing and works everywhere. ``PR_SET_PDEATHSIG`` is offered
as a faster extra, with its known trap: Linux sends the signal when the *thread*
that spawned the child exits, not the process -- only use it when the parent
spawns workers from a thread that lives as long as the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from types import FrameType

from aiolm.ipc.wakeup import pid_alive

_PR_SET_PDEATHSIG = 1


def parent_alive(expected_ppid: int) -> bool:
    """True while the process that started us (pid given on our command line) lives.

    Once the parent dies we are re-parented (to init or a subreaper), so the
    pid changes; comparing with the expected pid also covers a parent that died
    before this child got to run. The pid alone is not enough: a child spawned
    from one of the parent's threads is re-parented only when that thread has
    exited, which can be after the killed parent's leader is already a zombie
    and after a ring has reported the parent dead, so a zombie parent counts as
    dead too.
    """
    return os.getppid() == expected_ppid and pid_alive(expected_ppid)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` when the parent (thread) dies; False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Turn termination signals into ``SystemExit`` so ``finally`` and atexit cleanup run.

    Python's default for SIGTERM kills the process without unwinding, which would
    leave shared-memory names behind. Call from the main thread.
    """

    def _raise(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for sig in signals:
        signal.signal(sig, _raise)
