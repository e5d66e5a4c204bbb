"""Block pool, free queue, hashing and KVCacheManager rules."""

from __future__ import annotations

import ast
import pathlib

import pytest

from aiolm.core.kv_cache import (
    NULL_BLOCK_ID,
    BlockHasher,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    hash_block_tokens,
)

from .sim import make_request

BS = 4


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def manager(num_blocks: int = 9, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, hash_seed=0)


def run_prefill(kv: KVCacheManager, req, num_tokens: int | None = None) -> list[int]:
    """Allocate and 'compute' a request's prompt (with prefix hits) the way the scheduler does."""
    kv.attach(req)
    hits, n_hit = kv.get_computed_blocks(req)
    n = (num_tokens if num_tokens is not None else req.num_tokens) - n_hit
    assert kv.allocate_slots(req, n, n_hit, hits) is not None
    req.num_computed_tokens = n_hit + n
    kv.cache_blocks(req, req.num_computed_tokens)
    assert kv.check_invariants() == []
    return kv.get_block_ids(req.req_id)


# -- free queue ---------------------------------------------------------------------


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # O(1) unlink from the middle
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 1, 3, 4, 0]
    q.remove(blocks[0])  # tail
    q.remove(blocks[2])  # head
    assert ids(q) == [1, 3, 4]


def test_free_queue_rejects_misuse():
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    q = FreeBlockQueue([a])
    with pytest.raises(ValueError):
        q.append(a)
    with pytest.raises(ValueError):
        q.remove(b)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


# -- block pool ----------------------------------------------------------------------


def test_null_block_is_never_handed_out():
    pool = BlockPool(6)
    got = pool.get_new_blocks(5)
    assert NULL_BLOCK_ID not in ids(got)
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_unhashed_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h-a")
    pool.free_blocks([a, b])
    # b (no hash) went to the head, a (cached) to the tail.
    assert ids(pool.free_queue) == [b.block_id, 3, 4, a.block_id]


# -- hashing -------------------------------------------------------------------------


def test_hash_chaining_and_collision_safety():
    root = b"r" * 32
    h1 = hash_block_tokens(root, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(root, (1, 2, 3, 4))
    assert h1 != hash_block_tokens(root, [1, 2, 3, 5])
    assert h1 != hash_block_tokens(b"s" * 32, [1, 2, 3, 4])  # parent matters
    assert h1 != hash_block_tokens(root, [1, 2, 3, 4], ("salt",))
    assert hash_block_tokens(root, [12, 3]) != hash_block_tokens(root, [1, 23])  # no concatenation ambiguity

    hasher = BlockHasher(BS, seed=0)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    c = make_request("c", [9, 2, 3, 4, 5, 6, 7, 8])  # first block differs
    d = make_request("d", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant-1")
    for r in (a, b, c, d):
        r.set_block_hasher(hasher, BS)
    assert len(a.block_hashes) == 2  # full blocks only
    assert a.block_hashes == b.block_hashes
    assert c.block_hashes[0] != a.block_hashes[0]
    assert c.block_hashes[1] != a.block_hashes[1]  # same tokens, different prefix
    assert d.block_hashes[0] != a.block_hashes[0] and d.block_hashes[1] != a.block_hashes[1]


def test_hash_seed_fixed_is_reproducible_and_unset_is_random():
    assert BlockHasher(BS, seed=7).root == BlockHasher(BS, seed=7).root
    assert BlockHasher(BS, seed=7).root != BlockHasher(BS, seed=8).root
    assert BlockHasher(BS).root != BlockHasher(BS).root


def test_block_hashes_grow_incrementally_with_output():
    hasher = BlockHasher(BS, seed=0)
    r = make_request("r", [1, 2, 3])
    r.set_block_hasher(hasher, BS)
    assert r.block_hashes == []
    r.append_output_token_ids(4)
    assert len(r.block_hashes) == 1
    first = r.block_hashes[0]
    r.append_output_token_ids([5, 6, 7])
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([8, 9, 10, 11, 12])
    assert len(r.block_hashes) == 3 and r.block_hashes[0] == first
    whole = make_request("w", list(range(1, 13)))
    whole.set_block_hasher(hasher, BS)
    assert whole.block_hashes == r.block_hashes


# -- manager: allocation ---------------------------------------------------------------


def test_allocate_returns_none_without_partial_allocation():
    kv = manager(num_blocks=6)  # 5 usable
    a = make_request("a", 12)
    assert len(kv.allocate_slots(a, 12)) == 3
    b = make_request("b", 12)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 12) is None
    assert kv.num_free_blocks == free_before
    assert kv.get_block_ids("b") == []
    assert kv.allocate_slots(b, 8) is not None
    assert kv.num_free_blocks == 0
    assert kv.check_invariants() == []


def test_allocate_grows_only_when_the_last_block_fills():
    kv = manager()
    r = make_request("r", 4)
    assert len(kv.allocate_slots(r, 4)) == 1
    r.num_computed_tokens = 4
    r.append_output_token_ids(9)
    assert len(kv.allocate_slots(r, 1)) == 1  # token 5 needs block 2
    r.num_computed_tokens = 5
    r.append_output_token_ids(9)
    assert kv.allocate_slots(r, 1) == []  # token 6 fits in block 2


def test_usage_and_free_restore_everything():
    kv = manager(num_blocks=9)
    r = make_request("r", 10)
    run_prefill(kv, r)
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(3 / 8)
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert kv.check_invariants() == []


def test_finished_request_is_freed_tail_first():
    kv = manager(num_blocks=9)
    r = make_request("r", 12)
    blocks = run_prefill(kv, r)
    kv.free(r)
    queue = ids(kv.pool.free_queue)
    # All three are cached, so they go to the tail, last block nearest eviction.
    assert queue[-3:] == [blocks[2], blocks[1], blocks[0]]


def test_lru_eviction_order_of_cached_blocks():
    kv = manager(num_blocks=5)  # 4 usable
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    blocks_a = run_prefill(kv, a)
    b = make_request("b", [9, 9, 9, 9])
    blocks_b = run_prefill(kv, b)
    kv.free(a)  # freed first -> evicted first
    kv.free(b)
    assert ids(kv.pool.free_queue)[-3:] == [blocks_a[1], blocks_a[0], blocks_b[0]]
    plain = ids(kv.pool.free_queue)[0]
    c = make_request("c", [50] * 4)
    assert ids(kv.allocate_slots(c, 4)) == [plain]  # the unhashed block goes before any cached one
    assert len(kv.pool.cached) == 3
    c.num_computed_tokens = 4
    assert ids(kv.allocate_slots(c, 4)) == [blocks_a[1]]  # then the least recently freed cached one
    assert len(kv.pool.cached) == 2
    c.num_computed_tokens = 8
    assert ids(kv.allocate_slots(c, 4)) == [blocks_a[0]]
    assert kv.check_invariants() == []


# -- manager: prefix caching ---------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_stats():
    kv = manager(num_blocks=17)
    a = make_request("a", 10)
    blocks_a = run_prefill(kv, a)
    b = make_request("b", list(range(1, 9)) + [77, 78, 79])
    kv.attach(b)
    hits, n = kv.get_computed_blocks(b)
    assert ids(hits) == blocks_a[:2] and n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, n, hits) is not None
    assert kv.get_block_ids("b")[:2] == blocks_a[:2]
    assert kv.pool.blocks[blocks_a[0]].ref_cnt == 2
    assert kv.check_invariants() == []
    assert kv.stats.requests == 2 and kv.stats.queries == 21 and kv.stats.hits == 8
    assert kv.stats.hit_rate == pytest.approx(8 / 21)


def test_lookup_is_capped_at_num_tokens_minus_one():
    kv = manager(num_blocks=17)
    run_prefill(kv, make_request("a", 8))
    exact = make_request("b", 8)  # two full blocks, both cached
    kv.attach(exact)
    hits, n = kv.get_computed_blocks(exact)
    assert n == 4 and len(hits) == 1  # the last token must be computed for logits
    longer = make_request("c", list(range(1, 9)) + [3])
    kv.attach(longer)
    assert kv.get_computed_blocks(longer)[1] == 8


def test_only_computed_full_blocks_are_cached():
    kv = manager(num_blocks=17)
    a = make_request("a", 11)
    kv.attach(a)
    kv.allocate_slots(a, 11)
    kv.cache_blocks(a, 6)  # only block 0 is full and computed
    assert len(kv.pool.cached) == 1
    kv.cache_blocks(a, 11)
    assert len(kv.pool.cached) == 2  # block 2 (tokens 8..10) is not full


def test_cached_free_block_is_pulled_from_middle_of_free_queue():
    kv = manager(num_blocks=9)
    a = make_request("a", 8)
    blocks_a = run_prefill(kv, a)
    kv.free(a)
    assert set(blocks_a) <= set(ids(kv.pool.free_queue))
    b = make_request("b", 9)
    run_prefill(kv, b)
    assert kv.get_block_ids("b")[:2] == blocks_a
    assert not set(blocks_a) & set(ids(kv.pool.free_queue))
    assert kv.check_invariants() == []


def test_cached_block_is_evicted_only_when_the_pool_needs_it():
    kv = manager(num_blocks=6)  # 5 usable
    a = make_request("a", 8)
    blocks_a = run_prefill(kv, a)
    kv.free(a)
    filler = make_request("f", [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101])
    assert kv.allocate_slots(filler, 12) is not None  # 3 blocks: the uncached ones suffice
    assert len(kv.pool.cached) == 2
    probe = make_request("p", 9)
    kv.attach(probe)
    assert kv.get_computed_blocks(probe)[1] == 8  # still a hit
    filler.num_computed_tokens = 12
    assert kv.allocate_slots(filler, 1) is not None  # now a cached block must go: the LRU one
    assert blocks_a[1] in kv.get_block_ids("f")
    assert len(kv.pool.cached) == 1
    assert kv.get_computed_blocks(probe)[1] == 4  # chain is broken after block 0
    assert kv.check_invariants() == []


def test_allocation_counts_free_hit_blocks_against_capacity():
    kv = manager(num_blocks=5)  # 4 usable
    a = make_request("a", 8)
    run_prefill(kv, a)
    kv.free(a)  # 2 cached free + 2 plain free
    hog = make_request("h", 8)
    kv.allocate_slots(hog, 8)  # takes the 2 plain ones
    b = make_request("b", 13)  # hits 2 cached blocks and needs 2 new ones: only 2 free, both are the hits
    kv.attach(b)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 5, n, hits) is None
    assert kv.check_invariants() == []
    assert kv.allocate_slots(b, 0, n, hits) == []  # the hits alone do fit
    assert kv.check_invariants() == []


def test_same_prompt_computed_twice_keeps_one_cached_copy():
    kv = manager(num_blocks=17)
    a, b = make_request("a", 8), make_request("b", 8)
    for r in (a, b):
        kv.attach(r)
        kv.allocate_slots(r, 8)
        r.num_computed_tokens = 8
    for r in (a, b):
        kv.cache_blocks(r, 8)
    assert len(kv.pool.cached) == 2
    assert kv.check_invariants() == []
    kv.free(a)
    kv.free(b)
    assert kv.check_invariants() == [] and kv.num_free_blocks == 16


def test_prefix_caching_disabled_never_hits():
    kv = manager(caching=False)
    run_prefill(kv, make_request("a", 8))
    r = make_request("b", 9)
    assert kv.get_computed_blocks(r) == ([], 0)
    assert r.block_hashes == []


def test_reset_prefix_cache_drops_hashes():
    kv = manager(num_blocks=9)
    a = make_request("a", 8)
    run_prefill(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    probe = make_request("p", 9)
    kv.attach(probe)
    assert kv.get_computed_blocks(probe)[1] == 0
    assert kv.check_invariants() == []


def test_invariant_checker_catches_corruption():
    kv = manager()
    r = make_request("r", 8)
    kv.allocate_slots(r, 8)
    assert kv.check_invariants() == []
    kv.pool.blocks[kv.get_block_ids("r")[0]].ref_cnt += 1
    assert any("ref_cnt" in e for e in kv.check_invariants())


def test_core_imports_no_torch_or_numpy():
    core = pathlib.Path(__file__).resolve().parents[2] / "aiolm" / "core"
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("torch", "numpy"), f"{path.name} imports {name}"
