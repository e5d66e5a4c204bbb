"""Prefill/decode disaggregation with three tensor-parallel ranks on each side, engines in
this process, their workers real processes: each rank fetches its KV heads from the
producer's rank of the same number (through the sockets: shared memory off), the ranks agree on what was sent before the
producer frees a prompt's blocks, and greedy answers equal one TP=3 instance's. A
consumer with another tensor-parallel layout is refused at the handshake, which names
the difference, and computes the prompt itself."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from aiolm import AsyncEngine, SamplingParams
from aiolm.config import EngineArgs

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village, there lived " * 6,
    [{"role": "user", "content": "Name three rivers in Europe, briefly."}],
]
BASE = dict(dtype="float32", max_model_len=512, num_threads=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _final(engine: AsyncEngine, prompt, params: SamplingParams):
    outs = [o async for o in engine.generate(prompt, params)]
    return outs[-1]


def _tcp(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, **extra})


def test_three_ranks_each_side(caplog):
    async def main():
        port = _free_port()
        tp3 = dict(BASE, tensor_parallel_size=3, kv_cache_memory=16 << 20)
        engines = {
            "prefill": AsyncEngine(EngineArgs(**tp3, kv_transfer_config=_tcp("kv_producer", kv_port=port))),
            # KV through the sockets, not shared memory (tests/kv_transfer/test_pd_disaggregation.py)
            "decode": AsyncEngine(
                EngineArgs(
                    **tp3, kv_transfer_config=_tcp("kv_consumer", kv_connector_extra_config={"shared_memory": False})
                )
            ),
            "alone": AsyncEngine(EngineArgs(**tp3)),
            "decode_tp1": AsyncEngine(
                EngineArgs(**BASE, kv_cache_memory=48 << 20, kv_transfer_config=_tcp("kv_consumer"))
            ),
        }
        try:
            for e in engines.values():
                await e.start()
            greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            first = SamplingParams(max_tokens=1, temperature=0.0, kv_transfer_params={"do_remote_decode": True})
            for prompt in PROMPTS:
                alone = await _final(engines["alone"], prompt, greedy)
                pre = await _final(engines["prefill"], prompt, first)
                params = pre.kv_transfer_params
                assert params is not None and params["tp_size"] == 3
                dec = await _final(engines["decode"], prompt, greedy.clone(kv_transfer_params=params))
                assert dec.outputs[0].token_ids == alone.outputs[0].token_ids
                assert dec.num_cached_tokens == len(dec.prompt_token_ids) - 1
            sched = engines["prefill"].scheduler
            for _ in range(100):  # the last transfer's report comes with a later step
                if not sched.kv_cache_manager.leases:
                    break
                await asyncio.sleep(0.05)
            assert not sched.kv_cache_manager.leases and not sched.connector.sends
            assert engines["decode"].scheduler.connector.stats.failed_loads == 0
            # A TP=1 consumer: every field that differs is named, and it computes the prompt.
            pre = await _final(engines["prefill"], PROMPTS[0], first)
            one = await _final(
                engines["decode_tp1"], PROMPTS[0], greedy.clone(kv_transfer_params=pre.kv_transfer_params)
            )
            assert one.num_cached_tokens == 0 and len(one.outputs[0].token_ids) == 16
            assert engines["decode_tp1"].scheduler.connector.stats.failed_loads == 1
        finally:
            for e in engines.values():
                await e.shutdown()

    with caplog.at_level("WARNING"):
        asyncio.run(main())


@pytest.mark.parametrize(
    "config, message",
    [
        (_tcp("kv_producer", kv_port=0), "kv_port: must be a port number"),
        (
            _tcp("kv_consumer", kv_connector_extra_config={"transfer_timeout": 0}),
            "transfer_timeout: must be a positive number",
        ),
        (_tcp("kv_both", kv_connector_extra_config={"disk_path": "/x"}), "disk_path not supported by TcpConnector"),
        (_tcp("kv_sender"), "kv_role: 'kv_sender' is not one of"),
        # a consumer serves nothing, a producer fetches nothing: these were accepted and unused
        (_tcp("kv_consumer", kv_port=9000), "kv_port is a producer's"),
    ],
)
def test_bad_tcp_config_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(kv_transfer_config=config)
