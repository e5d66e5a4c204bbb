"""One writer -> N readers ring of fixed slots in one POSIX shared-memory segment.

Why this shape (after vLLM's ``ShmRingBuffer``, with counters instead of flags):
the writer publishes a monotonically growing count ``wr`` and each reader
publishes how many chunks it has consumed, ``rd[i]``. Slot ``k % num_slots`` may
be reused only once every attached reader has ``rd > k``, so a slow reader holds
the writer back and nothing is ever overwritten unread. Counters live on their
own cache lines so the writer and the readers do not fight over one line.

Segment layout (all words are little-endian u64)::

    [header 64B][writer line 64B][reader line 64B x N][slot 0]...[slot S-1]
    slot = [total_len u64][chunk_len u32 | flags u32][payload ... slot_size]

A message larger than one slot is split into consecutive chunks (FIRST/LAST
flags); a message larger than the whole ring streams through it, the writer
reusing slots as readers free them. So there is no overflow segment that could
leak: the only name on disk is the ring's own segment.

Waiting: a reader that finds nothing spins for ``spin_s`` (tens of microseconds,
cheap when messages arrive back to back), then sets its ``sleeping`` word,
re-checks, and blocks on its wakeup socket (see ``wakeup.py``). The writer pokes
only readers whose ``sleeping`` word is set, so a busy pipeline pays no syscall.
The writer waits for room the same way: it publishes ``wake_at`` and readers
poke it once they pass that count (half the ring free), so a full ring costs a
wakeup per half ring, not per message. ``read_async``/``write_async`` do the same
waits on an asyncio loop through ``add_reader``, never blocking it. Every block is
cut into short slices after which the peer's liveness is checked, so a SIGKILLed
peer turns into ``PeerDied`` instead of a hang.

Lifetime: the creator owns the segment (mode 0600, unique ``aiolm_<pid>_<hex>``
name, ``O_EXCL``) and unlinks it on ``close()`` and at exit. Anyone holding the
handle can ``unlink()`` it too (a worker whose parent was SIGKILLed, a parent
cleaning up after a dead child); unlinking twice is harmless.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiolm.ipc import segment
from aiolm.ipc.wakeup import Poker, WakeChannel, pid_alive, wake_address

__all__ = ["PeerDied", "RingClosed", "RingHandle", "ShmRing"]

_MAGIC = 0x31474E49524D4C41  # b"ALMRING1" little-endian
_VERSION = 1
# Word indexes (u64) into the control area.
_H_MAGIC, _H_VERSION, _H_READERS, _H_SLOTS, _H_SLOT_SIZE, _H_STRIDE, _H_WRITER_PID, _H_CLOSED = range(8)
_W_WR = 8  # chunks published by the writer
_W_WAKE_AT = 9  # 0, or: the writer sleeps until every reader's rd reaches this
_R_BASE = 16  # reader i: _R_BASE + 8 * i + (0: rd, 1: sleeping, 2: pid)
_LINE = 64
_SLOT_HDR = 16
_FIRST, _LAST = 1, 2
_DETACHED = (1 << 64) - 1  # reader pid word after a clean detach: writer stops waiting for it
_SLICE_S = 0.25  # longest single block before re-checking peers
_NAME_RE = segment.NAME_RE

_fence = segment.fence
_WEAK_ORDER = segment.WEAK_ORDER


class RingClosed(EOFError):
    """The writer closed the ring and every message has been read."""


class PeerDied(RuntimeError):
    """The process on the other side of the ring died without closing it."""


@dataclass(frozen=True)
class RingHandle:
    """What a process needs to attach: the segment name (the layout is in its header).

    ``str(handle)`` is safe to put on a command line; ``RingHandle.parse`` reverses it.
    """

    name: str

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"not an aiolm ring name: {self.name!r}")

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> RingHandle:
        return cls(text.strip().lstrip("/"))

    def unlink(self) -> bool:
        """Remove the segment name; False if it was already gone. Mappings stay valid."""
        return _unlink(self.name)


_unlink = segment.unlink


def _align(n: int, a: int = _LINE) -> int:
    return (n + a - 1) // a * a


def _new_segment(num_readers: int, num_slots: int, slot_size: int) -> tuple[str, mmap.mmap, Callable[[], bool]]:
    """A fresh segment with its header written: (name, its mapping, the at-exit unlink)."""
    if not 1 <= num_readers <= 256:
        raise ValueError(f"num_readers must be in 1..256, got {num_readers}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if not 64 <= slot_size < (1 << 32):
        raise ValueError(f"slot_size must be in [64, 2**32), got {slot_size}")
    stride = _align(_SLOT_HDR + slot_size)
    total = _align(_LINE * (2 + num_readers)) + stride * num_slots
    name, mm, hook = segment.create(total)
    u = memoryview(mm).cast("Q")
    u[_H_READERS], u[_H_SLOTS], u[_H_SLOT_SIZE], u[_H_STRIDE] = num_readers, num_slots, slot_size, stride
    u[_H_VERSION] = _VERSION
    u[_H_MAGIC] = _MAGIC  # last: marks the header complete
    u.release()
    return name, mm, hook


class ShmRing:
    """One end of a ring: the writer (``reader_rank is None``) or reader ``reader_rank``.

    Not thread-safe: use one object per thread. Readers may attach before or
    after the writer starts writing; a reader that never attaches blocks the
    writer once the ring is full (nothing is dropped).
    """

    def __init__(self, shm_name: str, mm: mmap.mmap, reader_rank: int | None, owner: bool, spin_s: float) -> None:
        self._name = shm_name
        self._mm = mm
        self._buf = memoryview(mm)
        self._u = self._buf.cast("Q")
        u = self._u
        if u[_H_MAGIC] != _MAGIC or u[_H_VERSION] != _VERSION:
            self._release_views()
            raise ValueError(f"{shm_name}: not an aiolm ring segment (or another version)")
        self._num_readers = int(u[_H_READERS])
        self._num_slots = int(u[_H_SLOTS])
        self._slot_size = int(u[_H_SLOT_SIZE])
        self._stride = int(u[_H_STRIDE])
        self._slots_off = _align(_LINE * (2 + self._num_readers))
        self._rank = reader_rank
        self._owner = owner
        self._spin_s = spin_s
        self._closed = False
        self._atexit: Callable[[], bool] | None = None
        self._poker = Poker()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None
        self._parts: list[bytes] = []
        if reader_rank is None:
            role = "w"
            self._reader_addrs = [wake_address(shm_name, f"r{i}") for i in range(self._num_readers)]
            self._reader_sleep_words = [_R_BASE + 8 * i + 1 for i in range(self._num_readers)]
        else:
            if not 0 <= reader_rank < self._num_readers:
                self._release_views()
                raise ValueError(f"reader_rank {reader_rank} out of range 0..{self._num_readers - 1}")
            role = f"r{reader_rank}"
            self._rd_word = _R_BASE + 8 * reader_rank
            self._sleep_word = self._rd_word + 1
            self._pid_word = self._rd_word + 2
            self._writer_addr = wake_address(shm_name, "w")
            if u[self._pid_word] == _DETACHED:
                self._release_views()
                raise RuntimeError(f"{shm_name}: reader {reader_rank} detached earlier and cannot rejoin")
        try:
            self._wake = WakeChannel(wake_address(shm_name, role))
        except OSError as e:
            self._poker.close()
            self._release_views()
            raise RuntimeError(f"{shm_name}: role {role!r} is already attached by a live process") from e
        if reader_rank is None:
            self._wr = int(u[_W_WR])
            self._free_until = 0  # cached: chunks may be published while wr < this
            self._wake_at = 0
            u[_H_WRITER_PID] = os.getpid()
        else:
            self._rd = int(u[self._rd_word])
            u[self._pid_word] = os.getpid()

    # ----------------------------------------------------------------- set-up

    @classmethod
    def create(
        cls,
        num_readers: int,
        num_slots: int = 16,
        slot_size: int = 1 << 20,
        *,
        reader_rank: int | None = None,
        spin_s: float = 100e-6,
    ) -> ShmRing:
        """Create a fresh ring segment and own it (unlinked on ``close()``/exit).

        The creator is the writer unless ``reader_rank`` is given (e.g. the engine
        creating a response ring that a worker attaches to as the writer).
        """
        name, mm, hook = _new_segment(num_readers, num_slots, slot_size)
        try:
            ring = cls(name, mm, reader_rank, True, spin_s)
        except BaseException:
            mm.close()
            _unlink(name)
            atexit.unregister(hook)
            raise
        ring._atexit = hook
        return ring

    @staticmethod
    def create_between(num_readers: int, num_slots: int = 16, slot_size: int = 1 << 20) -> RingHandle:
        """Create a ring for other processes (a pipeline stage writes it, the next reads it):
        the creator takes no end, owns the name, and unlinks it with ``handle.unlink()``."""
        name, mm, hook = _new_segment(num_readers, num_slots, slot_size)
        mm.close()
        # No unlink at exit: the creator unlinks it, or, if the creator dies first, the
        # processes that attached to it do (as worker processes do with their rings).
        atexit.unregister(hook)
        return RingHandle(name)

    @classmethod
    def attach(cls, handle: RingHandle | str, reader_rank: int | None, *, spin_s: float = 100e-6) -> ShmRing:
        """Open an existing ring as reader ``reader_rank`` (``None``: as its writer)."""
        if isinstance(handle, str):
            handle = RingHandle.parse(handle)
        mm = segment.attach(handle.name)
        try:
            return cls(handle.name, mm, reader_rank, False, spin_s)
        except BaseException:
            mm.close()
            raise

    def handle(self) -> RingHandle:
        return RingHandle(self._name)

    # ------------------------------------------------------------- properties

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_readers(self) -> int:
        return self._num_readers

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_size(self) -> int:
        return self._slot_size

    @property
    def reader_rank(self) -> int | None:
        return self._rank

    @property
    def is_writer(self) -> bool:
        return self._rank is None

    @property
    def closed(self) -> bool:
        """This end has been closed locally."""
        return self._closed

    @property
    def writer_closed(self) -> bool:
        """The writer announced shutdown (messages already written can still be read)."""
        return self._closed or bool(self._u[_H_CLOSED])

    @property
    def writer_alive(self) -> bool:
        """False once the writer closed the ring or its process died."""
        if self._closed or self._u[_H_CLOSED]:
            return False
        pid = int(self._u[_H_WRITER_PID])
        return pid == 0 or pid_alive(pid)

    def fileno(self) -> int:
        """Readable when the writer poked this reader (for ``loop.add_reader``).

        A poke only arrives while this reader's ``sleeping`` word is set; custom
        event-loop integrations should use ``read_async`` or mirror its protocol.
        """
        return self._wake.fileno()

    # ----------------------------------------------------------------- writer

    def write(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish one message to every reader; blocks while the ring is full.

        ``timeout`` bounds the wait for space (``TimeoutError``, nothing written).
        A message bigger than the whole ring streams through it: once its first
        chunk is out the writer keeps waiting (readers' liveness still checked).
        Raises ``PeerDied`` if a reader the writer waits for has died.
        """
        mv, n = self._payload(data)
        deadline = None if timeout is None else time.monotonic() + timeout
        if n <= self._slot_size:  # the common case: one slot
            if self._wr >= self._free_until:
                self._wait_room(1, deadline)
            self._put(mv, n, n, _FIRST | _LAST)
            return
        chunks = self._chunks(mv, n)
        self._wait_room(min(len(chunks), self._num_slots), deadline)
        for chunk, flags in chunks:
            if self._wr >= self._free_until:
                self._wait_room(1, None)
            self._put(chunk, len(chunk), n, flags)

    async def write_async(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """``write`` for an event loop: waits for space without blocking the loop."""
        mv, n = self._payload(data)
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks = self._chunks(mv, n)
        if self._wr + min(len(chunks), self._num_slots) > self._free_until:
            await self._wait_room_async(min(len(chunks), self._num_slots), deadline)
        for chunk, flags in chunks:
            if self._wr >= self._free_until:
                await self._wait_room_async(1, None)
            self._put(chunk, len(chunk), n, flags)

    def fits(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` would be written whole now, without waiting for room."""
        need = self._wr + max(1, -(-nbytes // self._slot_size))
        return need <= self._free_until or self._has_room(need)

    def _payload(self, data: bytes | bytearray | memoryview) -> tuple[memoryview, int]:
        if self._rank is not None:
            raise RuntimeError("write() on a reader end")
        if self._closed:
            raise RingClosed(f"{self._name}: ring closed")
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        return mv, mv.nbytes

    def _chunks(self, mv: memoryview, n: int) -> list[tuple[memoryview, int]]:
        cap = self._slot_size
        count = max(1, -(-n // cap))
        return [
            (mv[k * cap : min(n, (k + 1) * cap)], (_FIRST if k == 0 else 0) | (_LAST if k == count - 1 else 0))
            for k in range(count)
        ]

    def _put(self, chunk: memoryview, clen: int, total: int, flags: int) -> None:
        wr = self._wr
        off = self._slots_off + (wr % self._num_slots) * self._stride
        u = self._u
        w = off >> 3
        u[w] = total
        u[w + 1] = clen | (flags << 32)
        self._buf[off + _SLOT_HDR : off + _SLOT_HDR + clen] = chunk
        if _WEAK_ORDER:
            _fence()
        wr += 1
        self._wr = wr
        u[_W_WR] = wr
        _fence()
        for i, word in enumerate(self._reader_sleep_words):
            if u[word]:
                self._poker.poke(self._reader_addrs[i])

    def _has_room(self, need: int) -> bool:
        """Refresh the cached limit from the readers' counters; True if ``need`` fits."""
        u = self._u
        low = self._wr
        for i in range(self._num_readers):
            base = _R_BASE + 8 * i
            if u[base + 2] != _DETACHED:
                rd = u[base]
                if rd < low:
                    low = rd
        self._free_until = low + self._num_slots
        return need <= self._free_until

    def _prepare_room_wait(self, k: int) -> tuple[int, functools.partial, functools.partial]:
        need = self._wr + k
        # Ask to be woken when half the ring is free (or what this message needs),
        # not at the first free slot: a full ring would cost a wakeup per message.
        self._wake_at = max(need - self._num_slots, self._wr - self._num_slots // 2)
        return need, functools.partial(self._has_room, need), functools.partial(self._check_readers, need)

    def _wait_room(self, k: int, deadline: float | None) -> None:
        need, ready, on_idle = self._prepare_room_wait(k)
        if not ready():
            self._block(ready, deadline, on_idle, self._spin_s)

    async def _wait_room_async(self, k: int, deadline: float | None) -> None:
        need, ready, on_idle = self._prepare_room_wait(k)
        if not ready():
            await self._block_async(ready, deadline, on_idle, 0.0)

    def _check_readers(self, need: int) -> None:
        u = self._u
        for i in range(self._num_readers):
            base = _R_BASE + 8 * i
            pid = int(u[base + 2])
            if pid in (0, _DETACHED) or u[base] + self._num_slots >= need:
                continue
            if not pid_alive(pid):
                raise PeerDied(f"{self._name}: reader {i} (pid {pid}) died")

    # ----------------------------------------------------------------- reader

    def try_read(self) -> bytes | None:
        """The next message if one is complete, else None; never blocks.

        Raises ``RingClosed`` once the writer has closed and everything is read.
        """
        if self._closed:
            raise RingClosed(f"{self._name}: reader closed")
        u = self._u
        rd = self._rd
        while rd < u[_W_WR]:
            if _WEAK_ORDER:
                _fence()
            off = self._slots_off + (rd % self._num_slots) * self._stride
            meta = u[(off >> 3) + 1]
            chunk = bytes(self._buf[off + _SLOT_HDR : off + _SLOT_HDR + (meta & 0xFFFFFFFF)])
            if _WEAK_ORDER:
                _fence()
            rd += 1
            self._rd = rd
            u[self._rd_word] = rd
            _fence()
            wake_at = u[_W_WAKE_AT]
            if wake_at and rd >= wake_at:
                self._poker.poke(self._writer_addr)
            flags = meta >> 32
            if flags & _FIRST:
                if flags & _LAST:
                    return chunk
                self._parts = [chunk]
            else:
                self._parts.append(chunk)
                if flags & _LAST:
                    parts, self._parts = self._parts, []
                    return b"".join(parts)
        if u[_H_CLOSED]:
            _fence()
            if rd >= u[_W_WR]:
                raise RingClosed(f"{self._name}: writer closed the ring")
            return self.try_read()
        return None

    def read(self, timeout: float | None = None) -> bytes:
        """Block until the next message (spin briefly, then sleep on the wake socket).

        Raises ``TimeoutError`` after ``timeout`` seconds (callers use it to check
        on their parent), ``RingClosed`` after a clean close, ``PeerDied`` if the
        writer process is gone.
        """
        self._check_reader()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.try_read()
            if msg is not None:
                return msg
            self._block(self._ready, deadline, self._check_writer, self._spin_s)

    async def read_async(self, timeout: float | None = None, spin_s: float = 0.0) -> bytes:
        """Await the next message without blocking the event loop.

        The wake socket stays registered with the running loop (``add_reader``);
        the reader is marked sleeping only while a coroutine awaits, so writers
        pay the poke syscall only when someone actually waits. ``spin_s`` > 0
        polls that long first (it holds the loop; for latency benchmarks).
        """
        self._check_reader()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.try_read()
            if msg is not None:
                return msg
            await self._block_async(self._ready, deadline, self._check_writer, spin_s)

    def _check_reader(self) -> None:
        if self._rank is None:
            raise RuntimeError("read() on the writer end")
        if self._closed:
            raise RingClosed(f"{self._name}: reader closed")

    def _ready(self) -> bool:
        return self._u[_W_WR] > self._rd or bool(self._u[_H_CLOSED])

    def _check_writer(self) -> None:
        pid = int(self._u[_H_WRITER_PID])
        if pid and not pid_alive(pid) and not self._ready():
            raise PeerDied(f"{self._name}: writer (pid {pid}) died")

    # ------------------------------------------------------- sleeping protocol
    # The waiter arms its word (reader: sleeping=1, writer: wake_at=N), fences,
    # re-checks, then sleeps; the peer stores its counter, fences, reads the
    # word and pokes. One side always sees the other: no lost wakeup.

    def _arm(self) -> None:
        if self._rank is None:
            self._u[_W_WAKE_AT] = self._wake_at
        else:
            self._u[self._sleep_word] = 1
        _fence()

    def _disarm(self) -> None:
        if not self._closed:
            self._u[_W_WAKE_AT if self._rank is None else self._sleep_word] = 0

    def _slice(self, deadline: float | None) -> float:
        if deadline is None:
            return _SLICE_S
        left = deadline - time.monotonic()
        if left <= 0:
            self._disarm()
            raise TimeoutError(
                f"{self._name}: timed out waiting for the {'readers' if self._rank is None else 'writer'}"
            )
        return min(_SLICE_S, left)

    def _block(self, ready, deadline: float | None, on_idle, spin_s: float) -> None:
        """Return once ``ready()``: spin ``spin_s``, then sleep in slices."""
        spin_end = time.perf_counter() + spin_s
        while time.perf_counter() < spin_end:
            if ready():
                return
        while True:
            self._arm()
            if ready():
                self._disarm()
                return
            poked = self._wake.wait(self._slice(deadline))
            self._disarm()
            if poked:
                self._wake.drain()
            if ready():
                return
            if not poked:
                on_idle()

    async def _block_async(self, ready, deadline: float | None, on_idle, spin_s: float) -> None:
        spin_end = time.perf_counter() + spin_s
        while time.perf_counter() < spin_end:
            if ready():
                return
        if self._waiter is not None:
            raise RuntimeError(f"{self._name}: another coroutine is already waiting on this end")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._register(loop)
        try:
            while True:
                fut = loop.create_future()
                self._waiter = fut
                self._arm()
                if ready():
                    return
                timer = loop.call_later(self._slice(deadline), _resolve, fut, False)
                try:
                    poked = await fut
                finally:
                    timer.cancel()
                if self._closed:
                    raise RingClosed(f"{self._name}: closed while waiting")
                self._disarm()
                if ready():
                    return
                if not poked:
                    on_idle()
        finally:
            self._waiter = None
            self._disarm()

    def _register(self, loop: asyncio.AbstractEventLoop) -> None:
        self._unregister()
        loop.add_reader(self._wake.fileno(), self._on_readable)
        self._loop = loop

    def _unregister(self) -> None:
        old, self._loop = self._loop, None
        if old is not None and not old.is_closed():
            try:
                old.remove_reader(self._wake.fileno())
            except Exception:  # noqa: BLE001 - a loop in another thread or shutting down
                pass

    def _on_readable(self) -> None:
        self._wake.drain()
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(True)

    # ----------------------------------------------------------------- closing

    def close(self) -> None:
        """Detach this end; the writer also announces shutdown; the owner unlinks.

        Readers already attached keep their mapping and can drain what is left.
        """
        if self._closed:
            return
        u = self._u
        if self._rank is None:
            u[_H_CLOSED] = 1
            _fence()
            for addr in self._reader_addrs:
                self._poker.poke(addr)
        else:
            u[self._sleep_word] = 0
            u[self._pid_word] = _DETACHED
            _fence()
            self._poker.poke(self._writer_addr)
        self._closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)
        self._unregister()
        self._wake.close()
        self._poker.close()
        self._release_views()
        self._mm.close()
        if self._owner:
            self.unlink()

    def unlink(self) -> bool:
        """Remove the segment's name (idempotent); attached processes are unaffected."""
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        return _unlink(self._name)

    def _release_views(self) -> None:
        for view in (getattr(self, "_u", None), getattr(self, "_buf", None)):
            if view is not None:
                view.release()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "writer" if self._rank is None else f"reader {self._rank}"
        return (
            f"ShmRing({self._name}, {role}, readers={self._num_readers}, "
            f"slots={self._num_slots}x{self._slot_size}, closed={self._closed})"
        )


def _resolve(fut: asyncio.Future, value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
