"""Heartbeats across real processes: a beating worker is fresh, a stopped one is stalled within
STALL_S, and beats again after SIGCONT; the segment is private and goes with the board."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from aiolm.ipc.heartbeat import BEAT_S, STALL_S, HeartbeatBoard

BEATER = """
import sys, time
from aiolm.ipc.heartbeat import Heartbeat
beat = Heartbeat(sys.argv[1], int(sys.argv[2]))
for _ in range(3):
    beat.step_done()
print("ready", flush=True)
time.sleep(120)
"""


def _wait(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.fixture
def board():
    b = HeartbeatBoard(2)
    yield b
    b.close()


def test_a_stopped_rank_is_stalled_and_beats_again_after_sigcont(board):
    assert stat.S_IMODE(os.stat(f"/dev/shm/{board.name}").st_mode) == 0o600
    assert board.age(0) is None and board.age(1) is None and board.stalled() == []
    p = subprocess.Popen([sys.executable, "-c", BEATER, board.name, "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert board.steps(1) == 3 and board.steps(0) == 0
        assert board.age(1) < 2 * BEAT_S + 0.5 and board.age(0) is None  # rank 0 never beat: not stalled
        os.kill(p.pid, signal.SIGSTOP)
        took = _wait(lambda: board.stalled() != [], STALL_S + 2.0)
        assert took > STALL_S - 2 * BEAT_S  # not before its beats are really overdue
        ((rank, age),) = board.stalled()
        assert rank == 1 and age > STALL_S
        os.kill(p.pid, signal.SIGCONT)
        _wait(lambda: board.stalled() == [], 2.0)
        assert board.age(1) < 1.0
    finally:
        p.kill()
        p.wait()


def test_close_unlinks_the_segment():
    b = HeartbeatBoard(1)
    path = f"/dev/shm/{b.name}"
    assert os.path.exists(path)
    b.close()
    b.close()  # idempotent
    assert not os.path.exists(path)
