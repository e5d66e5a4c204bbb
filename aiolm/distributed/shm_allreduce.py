"""All-reduce and all-gather between the ranks of one machine through one shared segment.

Why not gloo: gloo sends every tensor through loopback TCP, a few hundred
microseconds per call at decode sizes, and a decoder layer makes two calls. Here
each rank copies its tensor into its own slot of a shared segment, publishes the
call's generation number, waits until every peer has published it, and then sums
all slots itself. Every rank adds the slots in the same fixed order (rank 0, 1, ..
N-1; bfloat16 and float16 accumulate in float32), so every rank gets the same bits.

Segment layout (created by the engine, attached by each rank; all words u64)::

    [header 64B: magic, version, world_size, slot_bytes]
    [rank line 64B x N: arrived generation, pid, sleeping]
    [buffer 0: slot x N][buffer 1: slot x N]

Generations and the two buffers: call g writes buffer g % 2. A rank may overwrite
its slot of buffer g % 2 once every peer has finished reading call g - 2, and a
peer that published g - 1 had finished g - 2 (it publishes a call only after it
completed the one before), which the rank saw while waiting in call g - 1. So
one barrier per call is enough. Tensors larger than a slot go through chunk by
chunk, one generation per chunk.

Waiting spins for a few tens of microseconds (peers usually arrive within
that), then sleeps on the rank's wake socket the way the rings do (ipc/wakeup.py):
it sets its ``sleeping`` word, re-checks, and blocks; a rank that publishes pokes
the peers whose ``sleeping`` word is set, so a busy group pays no syscall. Why not
sched_yield or short sleeps: on a loaded machine a yielding rank hands its core to
other processes for a whole time slice, while a rank woken from a blocking wait
runs at once. Every few milliseconds of sleep it checks that the peers it waits
for are alive (their pid is in the segment), so a SIGKILLed rank turns into
``PeerDied`` within a fraction of a second instead of a hang; a live peer that
never arrives raises ``TimeoutError`` after ``timeout_s``. After either error the
group is unusable (ranks' generations disagree), and the worker exits.

Lifetime: the creator (the engine, ``create``) owns the name: mode 0600, unique
``aiolm_<pid>_<hex>``, unlinked by ``unlink()`` and at exit (ipc/segment.py).
"""

from __future__ import annotations

import atexit
import errno
import os
import time
from collections.abc import Callable

import torch

from aiolm.ipc import segment
from aiolm.ipc.shm_ring import PeerDied
from aiolm.ipc.wakeup import Poker, WakeChannel, pid_alive, wake_address

__all__ = ["PeerDied", "ShmAllReduce", "create_segment", "default_slot_bytes"]

_MAGIC = 0x31524C414D4C41  # b"ALMALR1"
_VERSION = 1
_LINE = 64
_H_MAGIC, _H_VERSION, _H_WORLD, _H_SLOT = range(4)
_R_BASE = _LINE // 8  # rank r: word _R_BASE + 8 r = arrived generation, + 1 = pid, + 2 = sleeping
# Up to a prefill step's hidden states (2048 tokens x 576 float32 = 4.7 MB) in one chunk:
# every chunk is a barrier, and each barrier where a rank had to sleep costs a wake-up.
# But the whole segment stays within SEGMENT_BUDGET, as containers often give /dev/shm
# only 64 MB (and touching pages past a full tmpfs kills the process with SIGBUS).
MAX_SLOT_BYTES = 8 << 20
SEGMENT_BUDGET = 32 << 20
_SPIN_S = 30e-6  # polling before sleeping on the wake socket
_CHECK_S = 0.02  # how often a sleeping rank checks its peers' pids
_ACCUMULATE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def _data_offset(world_size: int) -> int:
    return _LINE * (1 + world_size)


def default_slot_bytes(world_size: int) -> int:
    return min(MAX_SLOT_BYTES, SEGMENT_BUDGET // (2 * world_size) // _LINE * _LINE)


def create_segment(world_size: int, slot_bytes: int | None = None) -> tuple[str, Callable[[], bool]]:
    """Create the segment for ``world_size`` ranks; returns its name and an unlink function.

    The caller (the engine) owns the name and calls the unlink function on shutdown;
    an atexit hook unlinks it otherwise. OSError if /dev/shm has no room for it.
    """
    if not 2 <= world_size <= 64:
        raise ValueError(f"world_size must be in 2..64, got {world_size}")
    slot_bytes = default_slot_bytes(world_size) if slot_bytes is None else slot_bytes
    if slot_bytes < _LINE or slot_bytes % _LINE:
        raise ValueError(f"slot_bytes must be a positive multiple of {_LINE}, got {slot_bytes}")
    size = _data_offset(world_size) + 2 * world_size * slot_bytes
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:  # no /dev/shm to ask: let the creation itself decide
        free = size
    if free < size:
        raise OSError(errno.ENOSPC, f"/dev/shm has {free >> 20} MiB free, the all-reduce needs {size >> 20} MiB")
    name, mm, hook = segment.create(size)
    u = memoryview(mm).cast("Q")
    u[_H_WORLD], u[_H_SLOT], u[_H_VERSION] = world_size, slot_bytes, _VERSION
    u[_H_MAGIC] = _MAGIC  # last: marks the header complete
    u.release()
    mm.close()

    def unlink() -> bool:
        atexit.unregister(hook)
        return segment.unlink(name)

    return name, unlink


class ShmAllReduce:
    """Rank ``rank``'s end of the segment ``name``. Not thread-safe: one caller at a time."""

    def __init__(self, name: str, rank: int, timeout_s: float = 600.0) -> None:
        self.name = name
        self._mm = segment.attach(name)
        self._u = memoryview(self._mm).cast("Q")
        u = self._u
        if u[_H_MAGIC] != _MAGIC or u[_H_VERSION] != _VERSION:
            self.close()
            raise ValueError(f"{name}: not an aiolm all-reduce segment (or another version)")
        self.world_size = int(u[_H_WORLD])
        self.slot_bytes = int(u[_H_SLOT])
        if not 0 <= rank < self.world_size:
            self.close()
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        self.rank = rank
        self.timeout_s = timeout_s
        self._gen = int(u[_R_BASE + 8 * rank])
        self._my_word = _R_BASE + 8 * rank
        peers = [p for p in range(self.world_size) if p != rank]
        self._peer_words = [_R_BASE + 8 * p for p in peers]
        self._peer_wakes = [(_R_BASE + 8 * p + 2, wake_address(name, f"r{p}")) for p in peers]
        try:
            self._wake = WakeChannel(wake_address(name, f"r{rank}"))
        except OSError as e:
            self.close()
            raise RuntimeError(f"{name}: rank {rank} is already attached by a live process") from e
        self._poker = Poker()
        u[self._my_word + 1] = os.getpid()
        data = torch.frombuffer(
            self._mm,
            dtype=torch.uint8,
            offset=_data_offset(self.world_size),
            count=2 * self.world_size * self.slot_bytes,
        )
        # _slots[buffer][rank]: raw bytes, viewed in the call's dtype
        self._slots = data.view(2, self.world_size, self.slot_bytes)
        self._broken: str | None = None

    # ------------------------------------------------------------------ waiting

    def _wait_all(self, gen: int) -> None:
        """Until every peer has published ``gen``; PeerDied / TimeoutError otherwise."""
        u = self._u
        pending = [w for w in self._peer_words if u[w] < gen]
        if pending:
            spin_until = time.perf_counter() + _SPIN_S
            while pending and time.perf_counter() < spin_until:
                pending = [w for w in pending if u[w] < gen]
        if pending:
            self._sleep_until(gen, pending)
        if segment.WEAK_ORDER:
            segment.fence()

    def _sleep_until(self, gen: int, pending: list[int]) -> None:
        u, sleep_word = self._u, self._my_word + 2
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                # Set ``sleeping``, then re-check: a peer publishes, then reads our word,
                # so one of the two always sees the other (no lost wake-up).
                u[sleep_word] = gen
                segment.fence()
                pending = [w for w in pending if u[w] < gen]
                if not pending:
                    return
                if not self._wake.wait(_CHECK_S):
                    self._check_peers(pending, time.monotonic() > deadline)
                self._wake.drain()
        finally:
            u[sleep_word] = 0

    def _check_peers(self, pending: list[int], late: bool) -> None:
        u = self._u
        ranks = [(w - _R_BASE) // 8 for w in pending]
        for w, r in zip(pending, ranks):
            pid = int(u[w + 1])
            if pid and not pid_alive(pid):
                self._broken = f"all-reduce peer rank {r} (pid {pid}) died"
                raise PeerDied(self._broken)
        if late:
            self._broken = f"all-reduce peer rank(s) {ranks} did not arrive within {self.timeout_s:g} s"
            raise TimeoutError(self._broken)

    def _publish(self, src: torch.Tensor) -> int:
        """Copy ``src`` (flat, at most one slot) into this rank's slot of the next call's
        buffer, announce it and wait for every peer's; returns the buffer's index."""
        if self._broken is not None:
            raise PeerDied(f"all-reduce group is unusable: {self._broken}")
        self._gen += 1
        buf = self._gen & 1
        self._slots[buf, self.rank].view(src.dtype)[: src.numel()].copy_(src)
        u = self._u
        if segment.WEAK_ORDER:
            segment.fence()
        u[self._my_word] = self._gen
        segment.fence()  # the publish before reading the peers' sleeping words
        for word, addr in self._peer_wakes:
            if u[word]:
                self._poker.poke(addr)
        self._wait_all(self._gen)
        return buf

    # --------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over ranks, in place when ``x`` is contiguous; every rank gets the same bits."""
        flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().view(-1)
        acc_dtype = _ACCUMULATE.get(flat.dtype)
        per = self.slot_bytes // flat.element_size()
        for off in range(0, flat.numel(), per):
            out = flat[off : off + per]
            m = out.numel()
            buf = self._publish(out)
            slots = [s.view(flat.dtype)[:m] for s in self._slots[buf]]
            if acc_dtype is None:
                torch.add(slots[0], slots[1], out=out)
                for s in slots[2:]:
                    out.add_(s)
            else:
                acc = slots[0].to(acc_dtype)
                for s in slots[1:]:
                    acc.add_(s)
                out.copy_(acc)
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        cols = x.shape[-1]
        rows = x.reshape(-1, cols)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.world_size, cols, dtype=x.dtype)
        per_rows = self.slot_bytes // (cols * x.element_size())
        if per_rows == 0:  # a row longer than a slot: gather flat, then interleave
            flat = rows.view(-1)
            parts = torch.empty(self.world_size, flat.numel(), dtype=x.dtype)
            per = self.slot_bytes // x.element_size()
            for off in range(0, flat.numel(), per):
                src = flat[off : off + per]
                buf = self._publish(src)
                for p, s in enumerate(self._slots[buf]):
                    parts[p, off : off + src.numel()].copy_(s.view(x.dtype)[: src.numel()])
            out.copy_(parts.view(self.world_size, -1, cols).transpose(0, 1))
        else:
            for r0 in range(0, rows.shape[0], per_rows):
                src = rows[r0 : r0 + per_rows]
                k = src.shape[0]
                buf = self._publish(src.reshape(-1))
                for p, s in enumerate(self._slots[buf]):
                    out[r0 : r0 + k, p].copy_(s.view(x.dtype)[: k * cols].view(k, cols))
        return out.view(*x.shape[:-1], self.world_size * cols)

    def close(self) -> None:
        """Unmap (the creator unlinks the name)."""
        for end in ("_wake", "_poker"):
            if end in self.__dict__:
                self.__dict__.pop(end).close()
        self.__dict__.pop("_slots", None)
        if getattr(self, "_u", None) is not None:
            self._u.release()
            self._u = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a tensor view still maps it; the mapping goes with the process
            pass
