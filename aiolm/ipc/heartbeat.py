"""Per-rank heartbeats in one shared segment: how the engine tells a stopped worker from a
busy one.

Each worker runs a daemon thread that stamps its rank's slot with ``time.monotonic()``
every ``BEAT_S`` seconds, whatever its main thread is doing. A step's kernels release
the GIL, so a rank deep in a long prefill keeps beating; a rank that is stopped
(SIGSTOP, a debugger), frozen or starved of CPU for seconds does not. CLOCK_MONOTONIC
is one clock for the whole machine on Linux, so the engine compares the stamps with
its own ``time.monotonic()``. The slot also counts the steps the rank has finished,
so that when a step times out the engine can name the rank that fell behind.

Layout: one 64-byte line per rank (no false sharing between writers): word 0 the
last beat (float64, 0.0 before the first), word 1 the steps finished (uint64),
word 2 the writer's pid. Aligned 8-byte stores and loads are single accesses on
every CPU aiolm runs on, so a reader sees an old or a new value, never a torn one.
The engine creates the segment (private, unlinked on every exit path like the rings:
ipc/segment.py); a worker whose engine died unlinks it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from aiolm.ipc import segment

BEAT_S = 0.25  # a rank's stamp is at most this old while it runs
# A rank whose stamp is older than this counts as stalled: ten missed beats, which
# no scheduling hiccup of a running process comes near, and /health says so well
# within a few seconds of the rank stopping.
STALL_S = 2.5
_LINE_WORDS = 8  # 64 bytes
_BEAT, _STEPS, _PID = 0, 1, 2


class HeartbeatBoard:
    """Engine side: the segment, and each rank's age and finished steps read from it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.name, self._mm, self._hook = segment.create(max(1, world_size) * _LINE_WORDS * 8)
        self._f = memoryview(self._mm).cast("d")
        self._u = memoryview(self._mm).cast("Q")

    def age(self, rank: int, now: float | None = None) -> float | None:
        """Seconds since rank's last beat; None before its first."""
        beat = self._f[rank * _LINE_WORDS + _BEAT]
        if beat == 0.0:
            return None
        return (time.monotonic() if now is None else now) - beat

    def steps(self, rank: int) -> int:
        return int(self._u[rank * _LINE_WORDS + _STEPS])

    def stalled(self, now: float | None = None) -> list[tuple[int, float]]:
        """(rank, seconds since its last beat) of every rank silent for over STALL_S."""
        now = time.monotonic() if now is None else now
        ages = ((r, self.age(r, now)) for r in range(self.world_size))
        return [(r, a) for r, a in ages if a is not None and a > STALL_S]

    def close(self) -> None:
        """Unmap and unlink (idempotent)."""
        if self._mm.closed:
            return
        self._f.release()
        self._u.release()
        self._mm.close()
        segment.unlink(self.name)
        atexit.unregister(self._hook)


class Heartbeat:
    """Worker side: beats for ``rank`` from a daemon thread until the process ends."""

    def __init__(self, name: str, rank: int) -> None:
        self._mm = segment.attach(name)
        self._base = rank * _LINE_WORDS
        self._f = memoryview(self._mm).cast("d")
        self._u = memoryview(self._mm).cast("Q")
        self._u[self._base + _PID] = os.getpid()
        self._f[self._base + _BEAT] = time.monotonic()
        threading.Thread(target=self._run, name="aiolm-heartbeat", daemon=True).start()

    def _run(self) -> None:
        beat = self._base + _BEAT
        while True:
            self._f[beat] = time.monotonic()
            time.sleep(BEAT_S)

    def step_done(self) -> None:
        """One more step finished on this rank (only this rank's thread writes the count)."""
        self._u[self._base + _STEPS] += 1
