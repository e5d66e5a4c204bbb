"""ShmRing with real processes and real shared memory: order, broadcast, chunking,
back-pressure, async reading, and no /dev/shm leftovers on any exit path."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aiolm.ipc import PeerDied, RingClosed, RingHandle, ShmRing
from aiolm.ipc.wakeup import pid_alive

sys.path.insert(0, str(Path(__file__).parent))
from ring_peer import check_message, make_message  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("ring_peer.py")
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")


class Peer:
    """A helper process whose stdout lines arrive on a queue (reads never hang a test)."""

    def __init__(self, *args: object) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        self.pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err.append), daemon=True),
        ]
        for t in self.pumps:
            t.start()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)
        sink(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def line(self, timeout: float = 20.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer {self.pid}: no output in {timeout}s; stderr: {self.stderr()}") from None
        if line is None:
            raise AssertionError(f"peer {self.pid} exited ({self.proc.poll()}); stderr: {self.stderr()}")
        return line.strip()

    def summary(self, timeout: float = 30.0) -> dict:
        return json.loads(self.line(timeout))

    def stderr(self) -> str:
        return "".join(s for s in self.err if s)[-3000:]

    def wait(self, timeout: float = 20.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for t in self.pumps:  # EOF once every holder of the pipes (grandchildren too) is gone
            t.join(5)
        if not any(t.is_alive() for t in self.pumps):
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture
def spawn():
    """Start helper processes; every one (and any grandchild it reports) dies at teardown."""
    peers: list[Peer] = []
    extra_pids: list[int] = []

    def _spawn(*args: object) -> Peer:
        peer = Peer(*args)
        peers.append(peer)
        return peer

    _spawn.extra_pids = extra_pids
    yield _spawn
    for pid in extra_pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for peer in peers:
        peer.kill()


@pytest.fixture
def no_leftovers():
    """Names registered here must be gone from /dev/shm at the end of the test."""
    names: list[str] = []
    yield names
    left = [n for n in names if (SHM / n).exists()]
    for n in left:
        RingHandle(n).unlink()
    assert not left, f"left behind in /dev/shm: {left}"


def shm_entries(*pids: int) -> list[str]:
    prefixes = tuple(f"aiolm_{pid}_" for pid in pids)
    return [p.name for p in SHM.iterdir() if p.name.startswith(prefixes)]


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def sizes_seq(count: int, sizes: list[int]) -> int:
    """Total bytes the peer sees for ``count`` messages with the ring_peer size cycle."""
    return sum(len(make_message(i, sizes[i % len(sizes)])) for i in range(count))


# ---------------------------------------------------------------- in-process


def test_basics_in_one_process(no_leftovers):
    w = ShmRing.create(1, num_slots=4, slot_size=64)
    no_leftovers.append(w.name)
    assert (SHM / w.name).stat().st_mode & 0o777 == 0o600
    h = RingHandle.parse(str(w.handle()))
    r = ShmRing.attach(h, 0)
    with pytest.raises(RuntimeError):
        ShmRing.attach(h, 0)  # one live process per role
    with pytest.raises(ValueError):
        RingHandle.parse("/etc/passwd")
    assert r.try_read() is None
    msgs = [b"", b"a", bytearray(b"xyz" * 10), memoryview(b"m" * 64)]
    for m in msgs:
        w.write(m)
    assert [r.read(timeout=1) for _ in msgs] == [bytes(m) for m in msgs]
    big = bytes(range(256))[:200]  # 4 chunks of a 64-byte slot, fits the ring
    w.write(big)
    assert r.read(timeout=1) == big
    import array

    ints = array.array("i", range(10))
    w.write(memoryview(ints))
    assert r.read(timeout=1) == ints.tobytes()
    for i in range(4):
        w.write(b"%d" % i)
    with pytest.raises(TimeoutError):
        w.write(b"no room", timeout=0.05)  # ring full, nothing written
    assert r.read() == b"0"
    w.write(b"4", timeout=1)
    with pytest.raises(TimeoutError):
        w.write(b"x" * 200, timeout=0.05)  # needs 4 free slots, only 0 are
    assert [r.read() for _ in range(4)] == [b"1", b"2", b"3", b"4"]
    with pytest.raises(TimeoutError):
        r.read(timeout=0.05)
    w.write(b"last")
    w.close()
    assert not (SHM / w.name).exists()  # the owner unlinks on close
    assert not r.writer_alive
    assert r.read() == b"last"  # still readable after the writer closed
    with pytest.raises(RingClosed):
        r.read(timeout=1)
    r.close()


def test_parent_death_signal_is_available():
    from aiolm.ipc.lifeline import parent_alive, set_parent_death_signal

    assert set_parent_death_signal(0) is sys.platform.startswith("linux")  # 0 clears it again
    assert parent_alive(os.getppid()) and not parent_alive(os.getppid() + 1)


def test_async_timeout_and_close(no_leftovers):
    w = ShmRing.create(1, 4, 64)
    no_leftovers.append(w.name)
    r = ShmRing.attach(w.handle(), 0)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await r.read_async(timeout=0.05)
        asyncio.get_running_loop().call_later(0.05, w.write, b"late")
        assert await r.read_async(timeout=2) == b"late"
        asyncio.get_running_loop().call_later(0.05, w.close)
        with pytest.raises(RingClosed):
            await r.read_async(timeout=2)

    asyncio.run(main())
    r.close()


# ---------------------------------------------------------------- processes


def test_broadcast_two_readers_order_and_chunking(spawn, no_leftovers):
    ring = ShmRing.create(2, num_slots=8, slot_size=4096)
    no_leftovers.append(ring.name)
    readers = [spawn("reader", ring.name, rank, 0, 0, 0) for rank in (0, 1)]
    for p in readers:
        assert p.line() == "attached"
    # 0 bytes .. several slots .. more than the whole ring (32 KiB): it streams through
    sizes = [0, 10, 100, 4084, 4085, 5000, 9000, 40000, 3]
    count = 900
    for seq in range(count):
        ring.write(make_message(seq, sizes[seq % len(sizes)]), timeout=10)
    ring.close()
    expect = sizes_seq(count, sizes)
    for p in readers:
        s = p.summary()
        assert (s["count"], s["bytes"]) == (count, expect)
        assert p.wait() == 0


def test_100k_small_messages_no_loss(spawn, no_leftovers):
    ring = ShmRing.create(1, num_slots=64, slot_size=64)
    no_leftovers.append(ring.name)
    p = spawn("reader", ring.name, 0, 0, 0, 0)
    assert p.line() == "attached"
    count = 100_000
    msgs = [make_message(i, 8) for i in range(count)]
    t0 = time.perf_counter()
    for m in msgs:
        ring.write(m)
    ring.close()
    s = p.summary(60)
    assert s["count"] == count and s["bytes"] == sum(map(len, msgs))
    print(f"100k messages: {time.perf_counter() - t0:.2f}s")


def cpu_seconds(pid: int) -> float:
    fields = (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]).split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_reader_sleeps_instead_of_spinning(spawn, no_leftovers):
    ring = ShmRing.create(1, num_slots=4, slot_size=64)
    no_leftovers.append(ring.name)
    p = spawn("reader", ring.name, 0, 0, 0, 0)
    assert p.line() == "attached"
    ring.write(make_message(0, 8))
    time.sleep(0.3)
    before = cpu_seconds(p.pid)
    time.sleep(1.0)
    assert cpu_seconds(p.pid) - before < 0.1  # a spinning reader would burn ~1 s
    ring.write(make_message(1, 8))  # and a poke still wakes it
    ring.close()
    assert p.summary()["count"] == 2


def test_slow_reader_holds_back_writer(spawn, no_leftovers):
    ring = ShmRing.create(2, num_slots=4, slot_size=256)
    no_leftovers.append(ring.name)
    fast = spawn("reader", ring.name, 0, 0, 0, 0)
    slow = spawn("reader", ring.name, 1, 0.005, 0, 0)  # 5 ms per message
    assert fast.line() == "attached" and slow.line() == "attached"
    count = 80
    t0 = time.perf_counter()
    for seq in range(count):
        ring.write(make_message(seq, 100))
    elapsed = time.perf_counter() - t0
    ring.close()
    # The writer could only run 4 messages ahead of the slow reader.
    assert elapsed > (count - 4) * 0.005 * 0.9
    for p in (fast, slow):
        assert p.summary()["count"] == count


def test_stalled_reader_write_timeout_then_no_gap(spawn, no_leftovers):
    ring = ShmRing.create(1, num_slots=2, slot_size=64)
    no_leftovers.append(ring.name)
    p = spawn("reader", ring.name, 0, 0, 1.0, 0)  # attached, sleeps 1 s before reading
    assert p.line() == "attached"
    ring.write(make_message(0, 8))
    ring.write(make_message(1, 8))
    with pytest.raises(TimeoutError):
        ring.write(make_message(2, 8), timeout=0.1)
    ring.write(make_message(2, 8), timeout=10)  # goes through once the reader catches up
    ring.close()
    assert p.summary()["count"] == 3  # the reader checked seq 0, 1, 2: nothing lost


def test_async_reader_keeps_loop_responsive(spawn, no_leftovers):
    """Engine side: the ring is created by the reader, a worker attaches as writer."""
    try:
        import uvloop

        new_loop = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        new_loop = asyncio.new_event_loop
    ring = ShmRing.create(1, num_slots=8, slot_size=1024, reader_rank=0)
    no_leftovers.append(ring.name)
    count, sizes = 1500, [16, 600, 3000]  # 3000 > slot: chunked
    writer = spawn("writer", ring.name, count, ",".join(map(str, sizes)))

    async def main() -> float:
        gaps = [0.0]
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        for seq in range(count):
            check_message(await ring.read_async(timeout=20), seq)
        with pytest.raises(RingClosed):
            await ring.read_async(timeout=20)
        done.set()
        await tick
        return max(gaps)

    loop = new_loop()
    try:
        max_gap = loop.run_until_complete(main())
    finally:
        loop.close()
    assert writer.line() == "attached" and writer.line() == "done"
    assert max_gap < 0.2, f"event loop stalled for {max_gap * 1e3:.0f} ms"
    ring.close()


def test_async_writer_waits_for_slow_reader_without_blocking_loop(spawn, no_leftovers):
    ring = ShmRing.create(1, num_slots=2, slot_size=128)
    no_leftovers.append(ring.name)
    slow = spawn("reader", ring.name, 0, 0.004, 0, 0)  # 4 ms per message
    assert slow.line() == "attached"
    count = 60

    async def main() -> float:
        gaps = [0.0]
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        for seq in range(count):
            # every third message spans 3 slots (more than the 2-slot ring): streams
            await ring.write_async(make_message(seq, 300 if seq % 3 == 0 else 40), timeout=20)
        done.set()
        await tick
        return max(gaps)

    t0 = time.perf_counter()
    max_gap = asyncio.run(main())
    assert time.perf_counter() - t0 > (count - 4) * 0.004 * 0.9  # really waited on the reader
    assert max_gap < 0.2, f"event loop stalled for {max_gap * 1e3:.0f} ms"
    ring.close()
    assert slow.summary()["count"] == count


def test_writer_sigkill_is_detected(spawn, no_leftovers):
    ring = ShmRing.create(1, num_slots=4, slot_size=256, reader_rank=0)
    no_leftovers.append(ring.name)
    writer = spawn("writer_forever", ring.name)
    assert writer.line() == "attached"
    check_message(ring.read(timeout=5), 0)
    assert ring.writer_alive
    writer.proc.send_signal(signal.SIGKILL)
    writer.proc.wait(5)
    t0 = time.monotonic()
    with pytest.raises(PeerDied):
        ring.read(timeout=10)

    async def read_async() -> None:
        with pytest.raises(PeerDied):
            await ring.read_async(timeout=10)

    asyncio.run(read_async())
    assert time.monotonic() - t0 < 3
    assert not ring.writer_alive
    ring.close()  # the reader owns this one: unlinked


def test_reader_sigkill_writer_fails_fast_and_cleans_up(spawn, no_leftovers):
    ring = ShmRing.create(1, num_slots=4, slot_size=256)
    no_leftovers.append(ring.name)
    p = spawn("reader", ring.name, 0, 0, 600, 0)  # attached, never reads
    assert p.line() == "attached"
    p.kill()
    for seq in range(4):
        ring.write(make_message(seq, 8))
    t0 = time.monotonic()
    with pytest.raises(PeerDied):
        ring.write(make_message(4, 8), timeout=10)
    assert time.monotonic() - t0 < 3
    ring.close()


def test_parent_unlinks_ring_of_sigkilled_child(spawn, no_leftovers):
    p = spawn("owner_child_ring", 4)
    name = p.summary()["ring"]
    no_leftovers.append(name)
    assert (SHM / name).exists()
    p.kill()
    assert (SHM / name).exists()  # SIGKILL ran no cleanup: the parent must
    assert RingHandle.parse(name).unlink() is True
    assert RingHandle.parse(name).unlink() is False  # idempotent


@pytest.mark.parametrize("how", ["normal", "exception", "sigterm", "sigkill"])
def test_owner_exit_paths_leave_nothing(spawn, no_leftovers, how):
    """Owner creates the ring and a reader child; however the owner ends, the child
    exits within seconds and nothing stays in /dev/shm."""
    owner = spawn("owner", 4, "hang" if how == "sigkill" else how)
    info = owner.summary()
    no_leftovers.append(info["ring"])
    child = info["child"]
    spawn.extra_pids.append(child)
    if how == "sigterm":
        owner.proc.send_signal(signal.SIGTERM)
    elif how == "sigkill":
        owner.proc.send_signal(signal.SIGKILL)
    rc = owner.wait(20)
    assert rc == {"normal": 0, "exception": 1, "sigterm": 128 + signal.SIGTERM, "sigkill": -signal.SIGKILL}[how], (
        owner.stderr()
    )
    wait_until(lambda: not pid_alive(child), 5, "the orphaned reader to exit")
    assert not (SHM / info["ring"]).exists()
    assert shm_entries(owner.pid, child) == []
