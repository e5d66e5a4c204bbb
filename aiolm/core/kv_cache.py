"""Paged KV cache bookkeeping: block pool, free queue, prefix-cache hashing.

Only logical state lives here (block ids, ref counts, hashes); the tensors are
the worker's. Design, after vLLM v1:

* Block 0 is the null block: never handed out, free to use as padding in
  block tables.
* Free blocks sit in a doubly linked list ordered by eviction priority (head is
  popped first). A free block may still hold a cached prefix (lazy eviction):
  its hash is dropped only when it is popped for reuse, and a prefix hit on it
  pulls it out of the middle of the list in O(1).
* Freed blocks that hold a cached prefix go to the tail, so cached blocks are
  evicted least-recently-freed first; a request's blocks are freed tail first,
  so its later blocks go before its shared prefix. Freed blocks without a hash
  are worthless for caching and go to the head, to be reused before any cached
  block is evicted.
* Block hashes chain: hash(parent_hash, tokens, extra_keys), so one hash names a
  whole prefix. The root parent is random per process unless a seed is given.

Pure Python: no torch or numpy.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from aiolm.core.request import Request

NULL_BLOCK_ID = 0


# -- hashing -------------------------------------------------------------------


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """Strong hash of one full block given its parent's hash (pickle is canonical here)."""
    payload = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=4)
    return hashlib.sha256(payload).digest()


def root_hash(seed: int | str | bytes | None) -> bytes:
    """The parent of every first block: random per process, or derived from ``seed``."""
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(b"aiolm-root-hash\0" + pickle.dumps(seed, protocol=4)).digest()


def _first_block_keys(request: Request) -> tuple:
    """What besides its tokens names a request's first block: its cache salt and its LoRA
    adapter, by id and folder (an adapter unloaded and another loaded under its name gets a
    new id, so it never finds the old one's blocks)."""
    keys: tuple = ()
    if request.cache_salt is not None:
        keys = (request.cache_salt,)
    if request.lora_request is not None:
        lora = request.lora_request
        keys += (("lora", lora.lora_int_id, lora.lora_path),)
    return keys


class BlockHasher:
    """Extends a request's ``block_hashes`` with its newly full blocks."""

    def __init__(self, block_size: int, seed: int | str | bytes | None = None) -> None:
        self.block_size = block_size
        self.root = root_hash(seed)

    def __call__(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * bs
        parent = hashes[-1] if hashes else self.root
        while start + bs <= len(tokens):
            # The salt and the LoRA adapter go into the first block only; chaining carries
            # them onwards, so two adapters (or salts) never share a block.
            extra = _first_block_keys(request) if start == 0 else ()
            if request.mm_inputs:  # the images whose embeddings the block's KV was computed from
                extra += tuple(("image", i.hash) for i in request.mm_inputs if i.overlaps(start, start + bs))
            parent = hash_block_tokens(parent, tokens[start : start + bs], extra)
            hashes.append(parent)
            start += bs


# -- blocks and the free queue -------------------------------------------------------


class KVCacheBlock:
    """One page of KV cache: who holds it and which prefix it caches."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop at the head, push at either end, remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep every link operation branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free = prev
        block.next_free = nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1


class BlockPool:
    """All blocks, their ref counts, the free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        # Told (block id, hash) when a block that caches a prefix is reused: a KV connector
        # keeps such blocks elsewhere (aiolm/kv_transfer/). None: they are simply forgotten.
        self.on_evict: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head; a cached one loses its hash only now (lazy eviction)."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            del self.cached[h]
            if self.on_evict is not None:
                self.on_evict(block.block_id, h)
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks are given in the order they should be evicted."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full, computed block; a hash already owned by another block is left alone."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Unpublish a block whose KV is not what its hash says (no connector keeps it)."""
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            del self.cached[h]
        block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (e.g. after new weights); returns how many were dropped."""
        n = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return n


# -- the manager the scheduler talks to ---------------------------------------------


@dataclass
class PrefixCacheStats:
    """Counted in tokens, like vLLM: queries = prompt tokens looked up, hits = tokens found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    # Lookups of requests that ran before (preempted, or carried over a worker restart): kept
    # apart, as vLLM keeps them, out of the exported counters; they show recomputation reusing
    # the cache.
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps requests to blocks: allocation, prefix-cache lookups and caching, freeing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_seed: int | str | bytes | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_hasher = BlockHasher(block_size, hash_seed) if enable_prefix_caching else None
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks no request owns any more that a worker may still write (a KV load of an
        # aborted request): held until the load is reported, then freed (``release``).
        self.leases: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # -- sizes -------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def held_elsewhere(self, req_id: str) -> int:
        """Blocks held by anything but request ``req_id``: other requests, a prefill
        instance's leases, KV loads in flight. None: every block it lacks is free or
        evictable, so a request short of blocks now will always be."""
        return self.num_usable_blocks - self.pool.num_free_blocks - len(self.req_to_blocks.get(req_id, ()))

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_usable_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ------------------------------------------------------

    def attach(self, request: Request) -> None:
        """Give the request the hasher so its block hashes grow as tokens arrive."""
        if self.block_hasher is not None:
            request.set_block_hasher(self.block_hasher, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix, capped at num_tokens - 1 so one token is left to compute."""
        if self.block_hasher is None:
            return [], 0
        if not request.block_hashes and request.num_tokens >= self.block_size:
            self.attach(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        cached = self.pool.cached
        for h in request.block_hashes[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if request.num_cached_tokens < 0:
            # Before the request first ran (or a KV load first settled it): as vLLM's counters,
            # a preempted or recovered request's lookups are recomputation, not traffic
            # (under KV pressure they would outnumber the prompts' own many times over).
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens
        else:
            self.stats.preempted_requests += 1
            self.stats.preempted_queries += request.num_tokens
            self.stats.preempted_hits += num_hit_tokens
        return hits, num_hit_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full *and* computed (KV actually written)."""
        if self.block_hasher is None:
            return
        req_id = request.req_id
        start = self._num_cached_blocks.get(req_id, 0)
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return
        blocks = self.req_to_blocks[req_id]
        hashes = request.block_hashes
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[req_id] = end

    def unpublish(self, request: Request) -> None:
        """Take back the prefix blocks ``request`` published itself (not those it found cached):
        the step that computed them failed for it, e.g. it ran without the LoRA adapter its
        hashes name, so a later prefix hit would read the wrong KV."""
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return
        start = max(request.num_cached_tokens, 0) // self.block_size
        for block in blocks[start : self._num_cached_blocks.get(request.req_id, 0)]:
            self.pool.uncache_block(block)
        self._num_cached_blocks[request.req_id] = min(start, self._num_cached_blocks.get(request.req_id, 0))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # -- allocation --------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones, or None.

        None means they do not fit; nothing is taken then (no partial allocation).
        ``new_computed_blocks`` are prefix hits from get_computed_blocks, covering
        ``num_new_computed_tokens`` tokens; they are referenced, not allocated.
        """
        blocks = self.req_to_blocks.get(request.req_id)
        num_have = len(blocks) if blocks is not None else 0
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-total // self.block_size)
        hits = new_computed_blocks or ()
        num_new = num_required - num_have - len(hits)
        if num_new <= 0 and not hits:
            return []  # the decode fast path: the last block still has room
        num_new = max(num_new, 0)
        # Hit blocks sitting in the free queue leave it when touched.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[request.req_id] = []
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            if self._num_cached_blocks.get(request.req_id, 0) == num_have:
                self._num_cached_blocks[request.req_id] = num_have + len(hits)
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so its prefix is evicted last."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def lease(self, request: Request, key: str) -> None:
        """Take the request's blocks from it without freeing them, held under ``key``
        (see ``leases``)."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        if blocks:
            self.leases[key] = blocks

    def release(self, key: str) -> None:
        """Free the blocks leased under ``key``, last block first."""
        blocks = self.leases.pop(key, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    # -- checking ----------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """Every broken invariant as a sentence; empty when the bookkeeping is sound."""
        errors: list[str] = []
        pool = self.pool
        owners = [0] * pool.num_blocks
        for req_id, blocks in [*self.req_to_blocks.items(), *self.leases.items()]:
            ids = [b.block_id for b in blocks]
            if len(set(ids)) != len(ids):
                errors.append(f"{req_id} owns a block twice: {ids}")
            for b in blocks:
                if b is not pool.blocks[b.block_id]:
                    errors.append(f"{req_id} holds a foreign block object {b}")
                owners[b.block_id] += 1
        if owners[NULL_BLOCK_ID]:
            errors.append("the null block is owned by a request")
        free = list(pool.free_queue)
        free_ids = {b.block_id for b in free}
        if len(free_ids) != len(free) or len(free) != len(pool.free_queue):
            errors.append("free queue has duplicates or a wrong length")
        if NULL_BLOCK_ID in free_ids:
            errors.append("the null block is in the free queue")
        for b in pool.blocks[1:]:
            if b.ref_cnt != owners[b.block_id]:
                errors.append(f"block {b.block_id} ref_cnt {b.ref_cnt} != owners {owners[b.block_id]}")
            if (b.ref_cnt == 0) != (b.block_id in free_ids):
                errors.append(f"block {b.block_id} ref_cnt {b.ref_cnt} but in_free_queue={b.block_id in free_ids}")
            if b.block_hash is not None and pool.cached.get(b.block_hash) is not b:
                errors.append(f"block {b.block_id} has a hash not mapped to it")
        for h, b in pool.cached.items():
            if b.block_hash != h:
                errors.append(f"hash map entry points at block {b.block_id} with another hash")
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        if used + len(free) != pool.num_blocks - 1:
            errors.append(f"free {len(free)} + used {used} != total {pool.num_blocks - 1}")
        for req_id, n in self._num_cached_blocks.items():
            if n > len(self.req_to_blocks.get(req_id, ())):
                errors.append(f"{req_id} claims {n} cached blocks but owns fewer")
        return errors
