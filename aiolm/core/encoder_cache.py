"""The scheduler's ledger of the workers' encoder cache: which images' embeddings the
workers hold, who still needs them, and which to drop when room is short.

The workers keep each encoded image's embeddings under its hash (worker/model_runner.py)
and drop exactly what ``take_freed`` lists, so this ledger is the cache's one source of
truth. An entry is referenced by every live request whose prompt holds that image; an
unreferenced entry stays for reuse (the same image in a later request is not encoded
again) until its room is wanted, least recently released first. Sizes are in embeddings
(= placeholder tokens). Pure Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheLedger:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size: dict[str, int] = {}
        self.refs: dict[str, set[str]] = {}
        self.idle: OrderedDict[str, None] = OrderedDict()  # unreferenced entries, oldest first
        self.used = 0
        self.encoded = 0  # images encoded since start (the stats' counter)
        self._freed: list[str] = []

    def holds(self, image_hash: str) -> bool:
        return image_hash in self.size

    def ref(self, req_id: str, image_hash: str) -> None:
        """``req_id`` needs the held entry ``image_hash`` until it releases it."""
        self.refs.setdefault(image_hash, set()).add(req_id)
        self.idle.pop(image_hash, None)

    def fits(self, length: int, kept: int = 0) -> bool:
        """Whether ``length`` more embeddings fit, counting what dropping idle entries frees
        except ``kept`` of them (idle entries about to be read, so not to be dropped)."""
        idle = sum(self.size[h] for h in self.idle)
        return self.used - idle + kept + length <= self.capacity

    def forget(self, image_hash: str) -> None:
        """An entry added this step that will not be encoded after all (its request was
        preempted before the step went out)."""
        self.used -= self.size.pop(image_hash)
        self.refs.pop(image_hash, None)
        self.idle.pop(image_hash, None)
        self.encoded -= 1

    def add(self, req_id: str, image_hash: str, length: int) -> None:
        """The workers encode ``image_hash`` this step; idle entries make room first."""
        while self.used + length > self.capacity and self.idle:
            old, _ = self.idle.popitem(last=False)
            self.used -= self.size.pop(old)
            self.refs.pop(old, None)
            self._freed.append(old)
        self.size[image_hash] = length
        self.used += length
        self.encoded += 1
        self.ref(req_id, image_hash)

    def release(self, req_id: str, hashes: list[str]) -> None:
        """``req_id`` finished or was preempted: its entries may go idle."""
        for h in hashes:
            users = self.refs.get(h)
            if users is None:
                continue
            users.discard(req_id)
            if not users and h in self.size:
                self.idle[h] = None

    def take_freed(self) -> list[str]:
        """Entries dropped since the last call, for the workers to drop too."""
        out, self._freed = self._freed, []
        return out

    def clear(self) -> None:
        """New workers hold nothing (after a restart); the counter carries on."""
        self.size.clear()
        self.refs.clear()
        self.idle.clear()
        self.used = 0
        self._freed = []
