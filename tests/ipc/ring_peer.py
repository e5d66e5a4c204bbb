"""Helper program for the ring tests: each mode is one role in a separate process.

Run as ``python tests/ipc/ring_peer.py MODE ...``. Messages carry their sequence
number and a CRC of their body so readers can prove order and integrity.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import types
import zlib
from pathlib import Path

if "aiolm" not in sys.modules:
    # Import aiolm.ipc without running aiolm/__init__.py, which pulls in the whole
    # engine and torch (seconds per process); these tests start many processes.
    _pkg = types.ModuleType("aiolm")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "aiolm")]
    sys.modules["aiolm"] = _pkg

from aiolm.ipc import PeerDied, RingClosed, ShmRing  # noqa: E402
from aiolm.ipc.lifeline import exit_on_signals, parent_alive  # noqa: E402

_HDR = struct.Struct("<QI")


def make_message(seq: int, size: int) -> bytes:
    """``size``-byte body derived from ``seq`` (cheap, but different per message)."""
    unit = seq.to_bytes(8, "little")
    body = (unit * (size // 8 + 1))[:size]
    return _HDR.pack(seq, zlib.crc32(body)) + body


def check_message(msg: bytes, expect_seq: int) -> None:
    seq, crc = _HDR.unpack_from(msg)
    if seq != expect_seq:
        raise AssertionError(f"expected message {expect_seq}, got {seq}")
    if zlib.crc32(memoryview(msg)[_HDR.size :]) != crc:
        raise AssertionError(f"message {seq} is corrupt")


def size_for(seq: int, sizes: list[int]) -> int:
    return sizes[seq % len(sizes)]


def reader(handle: str, rank: int, delay_s: float, stall_s: float, count_only: bool) -> None:
    """Read until the writer closes; verify every message; print a JSON summary."""
    ring = ShmRing.attach(handle, rank)
    print("attached", flush=True)
    if stall_s:
        time.sleep(stall_s)  # a reader that is attached but not reading
    n = 0
    nbytes = 0
    t0 = time.perf_counter()
    try:
        while True:
            try:
                msg = ring.read(timeout=10.0)
            except RingClosed:
                break
            if not count_only:
                check_message(msg, n)
            n += 1
            nbytes += len(msg)
            if delay_s:
                time.sleep(delay_s)
    finally:
        ring.close()
    print(json.dumps({"count": n, "bytes": nbytes, "seconds": time.perf_counter() - t0}), flush=True)


def writer(handle: str, count: int, sizes: list[int]) -> None:
    """Attach as the writer of a ring someone else owns; write, close."""
    ring = ShmRing.attach(handle, None)
    print("attached", flush=True)
    for seq in range(count):
        ring.write(make_message(seq, size_for(seq, sizes)))
    if count >= 0:
        ring.close()
    print("done", flush=True)


def writer_forever(handle: str) -> None:
    """Attach as writer, write one message, then hang (to be SIGKILLed)."""
    ring = ShmRing.attach(handle, None)
    ring.write(make_message(0, 16))
    print("attached", flush=True)
    time.sleep(600)


def orphan_reader(handle: str, rank: int, ppid: int) -> None:
    """A worker-like reader: exits and unlinks the ring when its parent or writer dies."""
    exit_on_signals()
    ring = ShmRing.attach(handle, rank)
    print("attached", flush=True)
    try:
        while True:
            try:
                ring.read(timeout=0.2)
            except TimeoutError:
                if not parent_alive(ppid):
                    break
            except (RingClosed, PeerDied):
                break
    finally:
        ring.unlink()  # the names are known here, so a SIGKILLed parent leaves nothing
        ring.close()


def owner(num_slots: int, how_to_end: str) -> None:
    """Create a ring, spawn an orphan_reader child, report both, then end as told."""
    if how_to_end == "sigterm":
        exit_on_signals()
    ring = ShmRing.create(1, num_slots, 256)
    child = subprocess.Popen(
        [sys.executable, __file__, "orphan_reader", ring.name, "0", str(os.getpid())], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "attached"
    for seq in range(5):
        ring.write(make_message(seq, 32))
    print(json.dumps({"ring": ring.name, "child": child.pid}), flush=True)
    if how_to_end == "normal":
        ring.close()
        child.wait(10)
    elif how_to_end == "exception":
        raise RuntimeError("owner crashed on purpose")  # atexit unlinks; the child notices
    else:  # "hang" (then SIGKILLed) or "sigterm" (SystemExit -> atexit)
        time.sleep(600)


def owner_child_ring(num_slots: int) -> None:
    """Create a ring (as writer) and hang: the test SIGKILLs us and must clean up."""
    ring = ShmRing.create(1, num_slots, 256)
    print(json.dumps({"ring": ring.name}), flush=True)
    time.sleep(600)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "reader":
        reader(argv[1], int(argv[2]), float(argv[3]), float(argv[4]), argv[5] == "1")
    elif mode == "writer":
        writer(argv[1], int(argv[2]), [int(s) for s in argv[3].split(",")])
    elif mode == "writer_forever":
        writer_forever(argv[1])
    elif mode == "orphan_reader":
        orphan_reader(argv[1], int(argv[2]), int(argv[3]))
    elif mode == "owner":
        owner(int(argv[1]), argv[2])
    elif mode == "owner_child_ring":
        owner_child_ring(int(argv[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
