"""Private POSIX shared-memory segments: the naming, creation and unlinking every
aiolm segment shares (the rings in shm_ring.py, the CPU all-reduce buffer).

A segment is created ``O_EXCL`` with mode 0600 under a unique name
``aiolm_<creator pid>_<hex>``, so tests and operators can tell whose it is, and an
atexit hook unlinks it unless its owner did so first. Anyone who knows the name may
unlink it too (unlinking twice is harmless); mappings stay valid after unlinking.
"""

from __future__ import annotations

import atexit
import functools
import mmap
import os
import platform
import re
import secrets
import threading
from collections.abc import Callable

import posix_ipc

NAME_RE = re.compile(r"^aiolm_[0-9]+_[0-9a-f]+$")

# x86 keeps stores in order and loads in order; other CPUs need a fence between a
# payload copy and the counter that publishes (or releases) it.
WEAK_ORDER = platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686", "x86"}

# A store->load fence: a lock round trip is a locked (sequentially consistent)
# instruction in every CPython build.
_fence_lock = threading.Lock()


def fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()


def unlink(name: str) -> bool:
    """Remove the segment name; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        return False
    return True


def create(size: int) -> tuple[str, mmap.mmap, Callable[[], bool]]:
    """A fresh zero-filled segment of ``size`` bytes, mapped: (name, mapping, atexit hook).

    The hook is registered with atexit; an owner that unlinks earlier should
    ``atexit.unregister`` it.
    """
    for _ in range(16):
        name = f"aiolm_{os.getpid()}_{secrets.token_hex(6)}"
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
            break
        except posix_ipc.ExistentialError:
            continue
    else:  # pragma: no cover - 16 random 48-bit collisions
        raise RuntimeError("could not pick a unique shared-memory name")
    hook = functools.partial(unlink, name)
    atexit.register(hook)
    try:
        mm = mmap.mmap(shm.fd, size)
    except BaseException:
        unlink(name)
        atexit.unregister(hook)
        raise
    finally:
        shm.close_fd()
    return name, mm, hook


def attach(name: str) -> mmap.mmap:
    """Map an existing segment by name (its whole size)."""
    if not NAME_RE.match(name):
        raise ValueError(f"not an aiolm segment name: {name!r}")
    shm = posix_ipc.SharedMemory("/" + name)
    try:
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()
