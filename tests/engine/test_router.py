"""PrefixRouter: prefix-cache affinity first, bounded by load; unavailable replicas skipped."""

from __future__ import annotations

import pytest

from aiolm.engine.router import PrefixRouter

BLOCK = 4


def _prompt(prefix: int, tail: int, blocks: int = 3) -> list[int]:
    """``blocks`` full blocks shared by every prompt with this ``prefix``, then a distinct tail."""
    return [prefix * 1000 + i for i in range(blocks * BLOCK)] + [tail, tail + 1]


def test_a_repeated_prefix_goes_back_to_its_replica_while_others_spread():
    r = PrefixRouter(3, BLOCK, slack=2)
    first = r.choose(_prompt(1, 0), [0, 0, 0])
    other = r.choose(_prompt(2, 0), [1 if i == first else 0 for i in range(3)])
    assert other != first
    loads = [0, 0, 0]
    loads[first] = 1  # busier, but within the slack
    assert r.choose(_prompt(1, 7), loads) == first
    assert r.stats.affinity[first] == 1 and sum(r.stats.routed) == 3


def test_the_longest_known_prefix_wins():
    r = PrefixRouter(2, BLOCK, slack=100)
    short = [9] * BLOCK
    assert r.choose(short + [1] * BLOCK, [0, 0]) == 0  # ties start at replica 0
    assert r.choose([5] * (2 * BLOCK), [1, 0]) == 1  # another prefix: the least loaded
    # A prompt that shares one block with replica 0's and nothing with replica 1's.
    assert r.choose(short + [2] * BLOCK, [5, 0]) == 0


def test_an_overloaded_or_unavailable_replica_loses_its_affinity():
    r = PrefixRouter(2, BLOCK, slack=2)
    p = _prompt(3, 0)
    home = r.choose(p, [0, 0])
    away = 1 - home
    loads = [0, 0]
    loads[home] = 3  # beyond least + slack
    assert r.choose(p, loads) == away
    # The table now points at the new replica; if that one is unavailable, the other serves.
    loads = [0, 0]
    loads[away] = None  # type: ignore[call-overload]
    assert r.choose(p, loads) == home
    with pytest.raises(ValueError):
        r.choose(p, [None, None])


def test_prompts_shorter_than_a_block_go_by_load_in_turn_and_the_table_is_bounded():
    r = PrefixRouter(2, BLOCK, capacity=5)
    assert [r.choose([1, 2], [0, 0]) for _ in range(4)] == [0, 1, 0, 1]
    assert r.prefix_hashes([1, 2]) == []
    for k in range(10):
        r.choose(_prompt(k, 0), [0, 0])
    assert len(r._table) == 5
    assert r.prefix_hashes(_prompt(1, 0)) == r.prefix_hashes(_prompt(1, 99))  # tails past the blocks do not count


def test_requests_in_flight_together_follow_each_others_prefix():
    """A burst sharing a prefix: each is picked before any replica answered the first (no
    record yet), and still all go to one replica while its load is within the slack."""
    r = PrefixRouter(2, BLOCK, slack=8)
    loads = [0, 0]
    picked = []
    for k in range(6):
        route = r.pick(_prompt(1, k), loads)
        loads[route.replica] += 1
        picked.append(route.replica)
    assert picked == [picked[0]] * 6 and r.stats.routed == [0, 0]  # counted only once added
