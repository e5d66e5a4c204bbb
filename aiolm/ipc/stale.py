"""Remove ring segments whose creator died without unlinking them.

A ring's name is ``aiolm_<creator pid>_<hex>`` (see shm_ring.py). Every exit path
of a live engine unlinks its own rings, and workers unlink them when the engine
was killed, but a SIGKILL of both (or of a whole container's processes) leaves
segments in /dev/shm that nobody owns. The executor sweeps them at start: only
segments of this user whose creator no longer runs; a creator pid reused by a
live process keeps its segments (they are swept once that process is gone).
"""

from __future__ import annotations

import logging
import os
import re

from aiolm.ipc.wakeup import pid_alive

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_SEGMENT = re.compile(r"^aiolm_([0-9]+)_[0-9a-f]+$")


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink this user's ring segments of dead creators; returns the names removed."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []  # no /dev/shm (not Linux): nothing to sweep
    removed = []
    uid = os.getuid()
    for name in names:
        m = _SEGMENT.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
        except OSError:
            continue  # raced with its owner or another sweeper
        removed.append(name)
    if removed:
        log.warning(
            "removed %d shared-memory segment(s) left by dead processes: %s", len(removed), ", ".join(removed[:8])
        )
    return removed
