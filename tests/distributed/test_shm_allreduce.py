"""The shared-memory all-reduce between real processes (allreduce_peer.py is one rank).

Ranks must agree bit for bit and match the float64 sum within rounding for every
dtype and size (one element to four slots and more, chunked); a SIGKILLed peer must
turn into an error within 2 s, never a hang; the segment never outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiolm.distributed.shm_allreduce import create_segment

PEER = str(Path(__file__).with_name("allreduce_peer.py"))


def _our_segments() -> set[str]:
    prefix = f"aiolm_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _start(mode: str, name: str, world: int, *extra: str) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen([sys.executable, PEER, mode, name, str(r), *extra], stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]


def _reap(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_bit_for_bit_and_match_the_float64_sum(world):
    before = _our_segments()
    name, unlink = create_segment(world, slot_bytes=4096)
    procs = _start("cases", name, world)
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        _reap(procs)
        assert unlink()
    assert [p.returncode for p in procs] == [0] * world, outs
    digests = [json.loads(o)["digests"] for o in outs]
    assert len(digests[0]) > 20
    for r in range(1, world):
        assert digests[r] == digests[0], f"rank {r} differs from rank 0"
    assert _our_segments() == before


def test_segment_is_private_and_unlinked():
    name, unlink = create_segment(2, slot_bytes=4096)
    try:
        assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    finally:
        assert unlink()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not unlink()  # twice is harmless


def _wait_attached(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "attached"


def test_sigkilled_peer_fails_the_waiting_rank_within_2s_and_leaves_nothing():
    before = _our_segments()
    name, unlink = create_segment(2, slot_bytes=4096)
    procs = _start("wait", name, 2)
    try:
        _wait_attached(procs)
        time.sleep(0.5)  # rank 0 is inside all_reduce, waiting for rank 1
        assert procs[0].poll() is None
        os.kill(procs[1].pid, signal.SIGKILL)  # stays a zombie: we do not reap it yet
        killed = time.monotonic()
        out = procs[0].communicate(timeout=10)[0]
        took = time.monotonic() - killed
    finally:
        _reap(procs)
        unlink()
    result = json.loads(out.strip().splitlines()[-1])
    assert procs[0].returncode == 3 and result["error"] == "PeerDied", out
    assert "rank 1" in result["message"]
    assert took < 2.0, took
    assert _our_segments() == before


def test_a_live_peer_that_never_arrives_times_out():
    name, unlink = create_segment(2, slot_bytes=4096)
    procs = _start("wait", name, 2, "0.5")
    try:
        _wait_attached(procs)
        out = procs[0].communicate(timeout=30)[0]
    finally:
        _reap(procs)
        unlink()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] == "TimeoutError" and 0.5 <= result["waited"] < 5, result
