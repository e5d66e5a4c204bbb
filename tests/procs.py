"""The processes a test looks for, read from /proc: one walk for every test that checks that
workers or compile processes started, were replaced or are gone."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str  # /proc/<pid>/stat's state letter: "Z" for a zombie
    cmdline: bytes  # empty for a zombie


def processes() -> list[Proc]:
    """Every process this user can read, skipping those that leave while being read."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]  # the name in parentheses may hold spaces
        found.append(Proc(int(d), int(ppid), state, cmd))
    return found


def live_running(marker: bytes, parent: int | None = None) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``, children of ``parent`` if given."""
    return [p.pid for p in processes() if marker in p.cmdline and p.state != "Z" and parent in (None, p.ppid)]
