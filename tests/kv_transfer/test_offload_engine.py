"""The OffloadingConnector through the whole engine, with real worker processes and a real
directory: a multi-turn chat workload whose histories need 4x the KV pool
(benchmarks/bench_kv_offload.py's) gives the same greedy tokens with the tiers as
without, most of the later turns' prompts come back from the tiers instead of being
computed, the disk tier keeps its cap, its blocks outlive the engine, and missing,
corrupt, truncated or foreign files cost recomputation, never a wrong token. With
three tensor-parallel ranks the ranks agree on what arrived (the fewest any has).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from aiolm.core.kv_cache import BlockHasher
from aiolm.core.request import Request
from aiolm.kv_transfer.block_files import HEADER_BYTES, file_name
from aiolm.params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kv_offload import EMBEDDED_BLOCK_BYTES, Workload, dir_bytes, offload_config, run  # noqa: E402

POOL_BLOCKS = 40  # 640 tokens; 8 conversations of ~310 tokens need 4x that
DISK_BLOCKS = 100  # fewer than the run saves, so the cap has to evict
POOL_BYTES = POOL_BLOCKS * EMBEDDED_BLOCK_BYTES
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory=POOL_BYTES, max_num_seqs=4, max_step_ms=0)
WORKLOAD = Workload(conversations=8, turns=3)
FIRST_TURN = Workload(conversations=8, turns=1)


def sound(engine) -> None:
    """Nothing leaked: every block free or cached, no lease, no load left; and /metrics
    counts what the connector did."""
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    assert kv.check_invariants() == []
    assert kv.usage == 0.0 and not kv.leases and not sched.loading and not sched.loaded_waiting
    if sched.connector is not None:
        text = engine.metrics.render().decode()
        hits = float(text.split("aiolm:external_prefix_cache_hits_total{")[1].split("}")[1].split()[0])
        queries = float(text.split("aiolm:external_prefix_cache_queries_total{")[1].split("}")[1].split()[0])
        assert hits == sched.connector.stats.loaded_tokens
        # Every admitted prompt's tokens past the local cache were asked of the tiers, the first
        # turns' (which no tier holds) too: the hit rate is a rate, not 100%.
        assert queries == sched.connector.stats.queried_tokens and queries > hits, (queries, hits)
        assert sched.connector.stats.loaded_blocks * 16 >= hits
        assert "aiolm:kv_connector_saved_blocks_total{" in text


def with_disk(path: Path, **extra) -> dict:
    disk_bytes = DISK_BLOCKS * (EMBEDDED_BLOCK_BYTES + HEADER_BYTES)
    return dict(ENGINE, kv_transfer_config=offload_config(str(path), disk_bytes, 8 * EMBEDDED_BLOCK_BYTES), **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    off = asyncio.run(run(WORKLOAD, ENGINE, inspect=sound))
    on = asyncio.run(run(WORKLOAD, with_disk(disk), inspect=sound))
    return off, on, disk


def test_same_greedy_tokens_as_without_the_tiers(runs):
    off, on, _ = runs
    assert on.tokens == off.tokens
    assert all(len(t) == WORKLOAD.max_tokens for t in on.tokens)


def test_later_turns_come_back_from_the_tiers(runs):
    off, on, _ = runs
    later = slice(WORKLOAD.conversations, None)
    assert sum(off.cached[later]) == 0  # the pool alone has evicted every history by its next turn
    # The disk cap (100 blocks) is under the histories' 160: a third of the later turns' tokens
    # still come back (the benchmark, with room for all, brings back 80% of what can be).
    assert sum(on.cached[later]) >= 0.35 * sum(on.prompt[later]), (on.cached, on.prompt)
    assert on.stats["loaded_blocks"] * 16 >= sum(on.cached[later]) // 2
    assert on.stats["failed_blocks"] == 0


def test_the_disk_tier_keeps_its_cap(runs):
    _, on, disk = runs
    assert on.stats["dropped_blocks"] > 0  # the cap was reached, and held by evicting
    (layout,) = [p for p in disk.iterdir() if p.is_dir()]  # one fingerprint: this model and layout
    files = list((layout / "rank0").glob("*.kv"))
    assert DISK_BLOCKS - 10 <= len(files) <= DISK_BLOCKS
    assert dir_bytes(disk) <= DISK_BLOCKS * (EMBEDDED_BLOCK_BYTES + HEADER_BYTES)
    assert not list(disk.rglob("*.tmp"))


def first_turn_blocks(disk: Path, conv: int) -> list[Path]:
    """The block files of conversation ``conv``'s first prompt, as the engine names them."""
    (layout,) = [p for p in disk.iterdir() if p.is_dir()]
    prompt = WORKLOAD.user_turn(conv, 0)
    req = Request("probe", prompt, SamplingParams(max_tokens=1))
    req.set_block_hasher(BlockHasher(16, layout.name), 16)
    return [layout / "rank0" / file_name(h) for h in req.block_hashes]


def test_the_disk_tier_outlives_the_engine_and_bad_files_are_recomputed(runs):
    off, on, disk = runs
    # Three kinds of damage, each in another conversation's first prompt (the first ones
    # the new engine serves: their 40 blocks fill its pool before it evicts, and saves, any).
    flipped, truncated, foreign = (first_turn_blocks(disk, c)[3] for c in (1, 2, 3))
    for f in (flipped, truncated, foreign):
        assert f.is_file(), f"{f.name} was not kept on disk"
    data = bytearray(flipped.read_bytes())
    data[HEADER_BYTES + 1000] ^= 0x40
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-5000])
    other = next(f for f in flipped.parent.glob("*.kv") if f not in (flipped, truncated, foreign))
    foreign.write_bytes(other.read_bytes())  # a sound file, of another block
    again = asyncio.run(run(FIRST_TURN, with_disk(disk), inspect=sound))
    assert again.tokens == off.tokens[: FIRST_TURN.conversations]
    assert sum(again.cached) > 0  # a new engine found the old one's blocks
    assert again.stats["failed_loads"] == 3
    assert again.cached[1] == again.cached[2] == again.cached[3] == 3 * 16  # up to the bad block


def test_three_ranks_agree_on_what_arrived(tmp_path):
    """TP=3: each rank keeps its own KV heads' files. A corrupt file on one rank only
    cuts the load where that rank's chain breaks, on every rank."""
    # Each rank holds a third of the KV heads: a third of the bytes gives the same 40 blocks.
    args = with_disk(tmp_path, tensor_parallel_size=3, kv_cache_memory=POOL_BLOCKS * EMBEDDED_BLOCK_BYTES // 3)
    first = asyncio.run(run(FIRST_TURN, args, inspect=sound))
    (layout,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {p.name for p in layout.iterdir()} == {"rank0", "rank1", "rank2"}
    # The first conversation's second block, on rank 1 only.
    victim = layout / "rank1" / first_turn_blocks(tmp_path, 0)[1].name
    assert victim.is_file()
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    second = asyncio.run(run(FIRST_TURN, args, inspect=sound))
    assert second.tokens == first.tokens
    assert second.cached[0] == 16  # rank 1's bad second block stops every rank there
    assert second.stats["failed_loads"] == 1 and sum(second.cached) > 16
