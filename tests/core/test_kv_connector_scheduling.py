"""The scheduler with a KV connector (aiolm/kv_transfer/): evicted prefixes come back
as loads, a request waits for its load outside the batch, a bad load costs only
recomputation, and no block is freed while a worker may still write it.

The simulated worker (sim.py) holds each block's tokens and the tiers' copies, and
checks that every cached or loaded prefix a request arrives with holds its tokens.
"""

from __future__ import annotations

from aiolm.core.request import RequestStatus
from aiolm.kv_transfer.offload_scheduler import OffloadScheduler

from .sim import Driver, check_scheduler, make_request, make_scheduler

PROMPT_A = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, and one token left to compute
PROMPT_B = list(range(20, 50))  # 30 tokens: enough to evict all of A's blocks from a pool of 8


def evicted_a(host: int = 4, disk: int = 10, num_blocks: int = 9, **kwargs):
    """A scheduler whose pool served A and then B, so A's prefix lives only in the tiers."""
    connector = OffloadScheduler(host, disk)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, connector=connector, max_model_len=40, **kwargs)
    d = Driver(sched)
    sched.add_request(make_request("a", PROMPT_A, max_tokens=1))
    d.drain()
    sched.add_request(make_request("b", PROMPT_B, max_tokens=1))
    d.drain()
    assert connector.stats.saved_blocks >= 3
    assert not any(sched.kv_cache_manager.pool.get_cached_block(h) for h in _hashes(sched, PROMPT_A))
    return sched, connector, d


def _hashes(sched, prompt):
    probe = make_request("probe", prompt)
    sched.kv_cache_manager.attach(probe)
    return probe.block_hashes


def test_evicted_prefix_is_loaded_not_computed():
    sched, connector, d = evicted_a()
    sched.add_request(make_request("a2", PROMPT_A, max_tokens=2))
    so, _ = d.step()
    # The load is asked for; the request waits for it, scheduled for nothing yet.
    assert so.kv_ops is not None and so.kv_ops.load_req_ids == ["a2"]
    assert len(so.kv_ops.load_hashes[0]) == 3
    assert so.num_scheduled_tokens == {}
    assert sched.requests["a2"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for _ in range(4):  # the workers copy it in at a later step's start and report it
        so, _ = d.step()
        assert so.num_scheduled_tokens == {}
        if sched.requests["a2"].status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    assert sched.requests["a2"].num_computed_tokens == 12
    so, _ = d.step()
    assert so.num_scheduled_tokens == {"a2": 1}  # only the last prompt token is computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12  # the worker sim checks the 12 tokens
    d.drain()
    assert d.finished["a2"].num_cached_tokens == 12
    assert connector.stats.loaded_blocks == 3 and connector.stats.failed_blocks == 0


def test_a_bad_block_is_recomputed_and_forgotten():
    sched, connector, d = evicted_a()
    d.worker.corrupt = 1.0  # each load finds one of its blocks bad
    sched.add_request(make_request("a2", PROMPT_A, max_tokens=2))
    d.drain()
    assert connector.stats.failed_blocks >= 1
    assert d.finished["a2"].finish_reason == "length" and len(d.outputs["a2"]) == 2
    bad = [h for h in _hashes(sched, PROMPT_A) if h not in connector]
    assert bad, "the bad block stays in the index"


def test_a_load_that_brings_nothing_counts_the_prompts_lookup_once():
    """The first block is gone from the tiers: the load brings nothing and the request looks
    its prefix up again, computing it all. It was counted twice, locally and of the tiers."""
    sched, connector, d = evicted_a()
    first = _hashes(sched, PROMPT_A)[0]
    d.worker.host.pop(first, None)
    d.worker.disk.pop(first, None)
    queried, looked_up = connector.stats.queried_tokens, sched.prefix_cache_stats.queries
    sched.add_request(make_request("a2", PROMPT_A, max_tokens=2))
    d.drain()
    assert connector.stats.failed_loads == 1 and connector.stats.loaded_tokens == 0
    assert connector.stats.queried_tokens - queried == 13 and sched.prefix_cache_stats.queries - looked_up == 13


def test_abort_while_loading_keeps_blocks_until_the_load_is_reported():
    sched, connector, d = evicted_a()
    sched.add_request(make_request("a2", PROMPT_A, max_tokens=2))
    d.step()
    held = sched.kv_cache_manager.get_block_ids("a2")
    outs = sched.abort_requests(["a2"])
    assert [o.finish_reason for o in outs] == ["abort"]
    kv = sched.kv_cache_manager
    assert [b.block_id for b in kv.leases["load-1"]] == held  # a worker may still write them
    assert all(kv.pool.blocks[b].ref_cnt == 1 for b in held)
    assert sched.has_unfinished_requests()  # the engine keeps stepping until the report
    for _ in range(4):
        d.step()
        if not kv.leases:
            break
    assert not kv.leases and kv.usage == 0.0
    assert not sched.has_unfinished_requests()
    check_scheduler(sched)


def test_workers_replaced_during_a_load():
    sched, connector, d = evicted_a()
    sched.add_request(make_request("a2", PROMPT_A, max_tokens=3))
    d.step()
    sched.reset_workers(9)
    d.worker = type(d.worker)(block_size=4, disk=d.worker.disk)
    assert sched.requests["a2"].status == RequestStatus.WAITING and not sched.loading
    check_scheduler(sched)
    d.drain()
    assert len(d.outputs["a2"]) == 3


def test_a_loaded_prompt_gives_its_blocks_back_before_anyone_waits_or_is_preempted():
    """A load landed, but a request ahead of it (priority) needs the blocks: the loaded
    prompt lets go of them (what it loaded stays cached) rather than block the queue."""
    sched, connector, d = evicted_a(policy="priority")
    sched.add_request(make_request("p", [7] * 8, max_tokens=8, ignore_eos=True))
    d.step()
    sched.add_request(make_request("a2", PROMPT_A, max_tokens=1, priority=5, arrival_time=1e9))
    for _ in range(6):
        d.step()
        if sched.loaded_waiting:
            break
    assert [r.req_id for r in sched.loaded_waiting] == ["a2"]
    assert len(sched.kv_cache_manager.get_blocks("a2")) == 3
    # 20 tokens: 5 blocks, with p's 3 the whole pool of 8.
    sched.add_request(make_request("q", [9] * 20, max_tokens=1, arrival_time=0.0))
    so, _ = d.step()
    assert "q" in so.num_scheduled_tokens and not sched.loaded_waiting
    assert sched.requests["a2"].num_computed_tokens == 0 and not sched.kv_cache_manager.get_blocks("a2")
    d.drain()
    assert sched.num_preemptions == 0
    assert set(d.finished) >= {"p", "a2", "q"} and d.finished["a2"].finish_reason == "length"


def test_tiers_keep_their_caps():
    connector = OffloadScheduler(2, 5)
    sched = make_scheduler(num_blocks=6, block_size=4, connector=connector, max_model_len=24)
    d = Driver(sched)
    for i in range(12):
        sched.add_request(make_request(f"r{i}", [100 + i] * 4 + list(range(1, 10)), max_tokens=1))
        d.drain()
        assert len(connector.host) <= 2 and len(connector.disk) <= 5
    assert connector.stats.dropped_blocks > 0
    assert set(d.worker.host) == set(connector.host) and set(d.worker.disk) == set(connector.disk)


def test_a_prefill_instance_keeps_a_finished_prompts_blocks_until_sent_or_expired():
    """TcpConnector producer: a do_remote_decode request's blocks outlive it, leased, until
    every rank reports them sent (or the lease ends); the answer says where they are."""
    from aiolm.kv_transfer.config import parse_kv_transfer_config
    from aiolm.kv_transfer.pd_scheduler import PDScheduler

    cfg = parse_kv_transfer_config(
        '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 9000, '
        '"kv_connector_extra_config": {"lease_seconds": 5}}'
    )
    assert cfg is not None
    connector = PDScheduler(cfg, tp_size=1)
    sched = make_scheduler(num_blocks=16, block_size=4, connector=connector)
    d = Driver(sched)
    remote = {"do_remote_decode": True}
    for rid in ("x", "y"):
        sched.add_request(make_request(rid, PROMPT_A, max_tokens=1, kv_transfer_params=remote))
    for _ in range(5):
        d.step()
        if {"x", "y"} <= set(d.finished):
            break
    kv = sched.kv_cache_manager
    params = {rid: d.finished[rid].kv_transfer_params for rid in ("x", "y")}
    for p in params.values():
        assert p["do_remote_prefill"] and p["remote_port"] == 9000 and len(p["remote_block_ids"]) == 4
        assert kv.leases[f"send-{p['remote_request_id']}"]  # held past the request
    assert sched.has_unfinished_requests()  # the engine keeps stepping for the consumer
    so = sched.schedule()
    assert so.kv_ops is not None and so.kv_ops.serve_ids == [
        params["x"]["remote_request_id"],
        params["y"]["remote_request_id"],
    ]
    # x is fetched: every rank reports it sent, and its blocks are freed.
    from aiolm.core.step import ModelRunnerOutput

    sched.update_from_output(so, ModelRunnerOutput([], [], kv_sent=[params["x"]["remote_request_id"]]))
    assert f"send-{params['x']['remote_request_id']}" not in kv.leases
    # y is never fetched: its lease ends, and the workers are told to stop serving it.
    connector.sends[params["y"]["remote_request_id"]] = 0.0
    so = sched.schedule()
    assert so.kv_ops is not None and params["y"]["remote_request_id"] in so.kv_ops.unserve_ids
    assert not kv.leases and kv.usage == 0.0 and kv.check_invariants() == []
    assert not sched.has_unfinished_requests()


def test_a_request_waits_for_leased_blocks_instead_of_failing():
    """Blocks a prefill instance keeps for its decode instance come back when the lease ends:
    a request that fits the pool but not what is left waits for them (it was failed as
    needing more KV cache than exists), and one that can never fit still fails at once."""
    from aiolm.kv_transfer.config import parse_kv_transfer_config
    from aiolm.kv_transfer.pd_scheduler import PDScheduler

    cfg = parse_kv_transfer_config(
        '{"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": 9000, '
        '"kv_connector_extra_config": {"lease_seconds": 5}}'
    )
    assert cfg is not None
    connector = PDScheduler(cfg, tp_size=1)
    sched = make_scheduler(num_blocks=9, block_size=4, connector=connector, max_model_len=40)  # 8 usable
    d = Driver(sched)
    leased = list(range(100, 120))  # 20 tokens: 5 blocks leased once it finishes
    sched.add_request(make_request("held", leased, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    for _ in range(5):
        d.step()
        if "held" in d.finished:
            break
    kv = sched.kv_cache_manager
    assert kv.leases and kv.held_elsewhere("next") == 5
    sched.add_request(make_request("next", list(range(200, 216)), max_tokens=2))  # 4 + 1 blocks: waits
    for _ in range(3):
        d.step()
    assert "next" not in d.finished and sched.requests["next"].status == RequestStatus.WAITING
    (transfer_id,) = connector.sends
    connector.sends[transfer_id] = 0.0  # the lease ends unfetched
    for _ in range(6):
        d.step()
        if "next" in d.finished:
            break
    assert d.finished["next"].finish_reason == "length"
    sched.add_request(make_request("huge", list(range(300, 336)), max_tokens=1))  # 10 blocks of 8
    for _ in range(3):
        d.step()
    assert d.finished["huge"].finish_reason == "error"
    assert kv.usage == 0.0 and kv.check_invariants() == []


def test_a_decode_instance_that_will_not_fetch_releases_the_producers_blocks():
    """TcpConnector consumer: a request whose prompt a local prefix hit holds whole, one
    with prompt logprobs (no cached prefix, so no load), and one aborted before it ran never
    fetch their transfers; each is released to its producer (the workers fetch none of its
    blocks), which freed them only when its lease ran out (120 s by default)."""
    from aiolm.kv_transfer.config import parse_kv_transfer_config
    from aiolm.kv_transfer.pd_scheduler import PDScheduler

    cfg = parse_kv_transfer_config('{"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}')
    assert cfg is not None
    sched = make_scheduler(num_blocks=32, block_size=4, connector=PDScheduler(cfg, tp_size=1))
    d = Driver(sched)
    sched.add_request(make_request("local", PROMPT_A, max_tokens=1))  # its blocks now cached here
    d.drain()

    def remote(transfer_id: str) -> dict:
        return {
            "do_remote_prefill": True,
            "remote_host": "10.0.0.2",
            "remote_port": 9000,
            "remote_block_ids": [7, 8, 9, 10],
            "remote_request_id": transfer_id,
        }

    released: list[str] = []

    def step() -> None:
        so, _ = d.step()
        if so.kv_ops is not None:
            assert not so.kv_ops.load_ids  # nothing is fetched
            assert all(s == "10.0.0.2:9000" for s in so.kv_ops.release_sources)
            released.extend(so.kv_ops.release_transfer_ids)

    sched.add_request(make_request("hit", PROMPT_A, max_tokens=2, kv_transfer_params=remote("t-hit")))
    step()
    assert released == ["t-hit"]  # at once, not when the request ends
    sched.add_request(
        make_request("scored", PROMPT_A, max_tokens=1, prompt_logprobs=1, kv_transfer_params=remote("t-scored"))
    )
    sched.add_request(make_request("gone", PROMPT_A, max_tokens=1, kv_transfer_params=remote("t-gone")))
    d.record(sched.abort_requests(["gone"]))
    for _ in range(6):
        step()
    assert sorted(released) == ["t-gone", "t-hit", "t-scored"]  # each once
    assert {"hit", "scored", "gone"} <= set(d.finished)
    assert sched.kv_cache_manager.check_invariants() == []
    # alone on an idle engine: the release queued as it ends keeps the engine stepping until sent
    sched.add_request(
        make_request("solo", PROMPT_A, max_tokens=1, prompt_logprobs=1, kv_transfer_params=remote("t-solo"))
    )
    for _ in range(8):
        step()
        if not sched.has_unfinished_requests():
            break
    assert released[-1] == "t-solo" and "solo" in d.finished
    # a transfer already released is not released again (n > 1 siblings share their parent's)
    sched.add_request(make_request("again", PROMPT_A, max_tokens=1, kv_transfer_params=remote("t-hit")))
    for _ in range(4):
        step()
    assert released.count("t-hit") == 1
