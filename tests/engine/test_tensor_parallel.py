"""Tensor parallelism end to end: the same greedy tokens as one rank, and a killed rank.

TP=3 on the embedded SmolLM2 (9 heads, 3 KV heads: one KV head per rank) and TP=2
on a tiny random Llama with one KV head (replicated on both ranks) must give the
tokens of TP=1 in float32, 48 of them per prompt, a chat prompt included. Then a
rank is SIGKILLed while requests stream: they fail within 2 s, and shutdown leaves
no process and no shared memory. Each engine start costs seconds, so each engine
serves both checks.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from engine_harness import ENGINE_ARGS, LoopThread, our_segments

from aiolm import AsyncEngine, EngineDeadError, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    [{"role": "user", "content": "What is tensor parallelism? Answer briefly."}],
]
MAX_NEW = 48


async def _greedy_tokens(engine: AsyncEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def one(prompt) -> list[int]:
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


async def _kill_rank_while_streaming(engine: AsyncEngine, rank: int) -> list[float]:
    """SIGKILL ``rank`` once three long streams run; seconds until each stream failed."""
    started = [asyncio.Event() for _ in range(3)]

    async def consume(i: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
        try:
            async for _ in engine.generate(f"Story number {i}:", params):
                started[i].set()
        except EngineDeadError:
            return time.monotonic()
        raise AssertionError("stream ended without EngineDeadError")

    tasks = [asyncio.ensure_future(consume(i)) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    engine.executor.procs[rank].kill()  # type: ignore[union-attr]
    killed = time.monotonic()
    ends = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return [t - killed for t in ends]


def _run_tp(model: str | None, tp: int, kill_rank: int | None = None) -> list[list[int]]:
    """Greedy tokens of PROMPTS with ``tp`` ranks; then optionally kill a rank mid-stream."""
    before = our_segments()
    lt = LoopThread()
    # With a rank to kill, recovery is off: this checks the fail-fast path (tests/reliability
    # covers recovery).
    engine = AsyncEngine(
        model=model, tensor_parallel_size=tp, dtype="float32", **ENGINE_ARGS, worker_recovery=kill_rank is None
    )
    try:
        lt.run(engine.start(), timeout=600)
        ex = engine.executor
        if tp > 1:
            assert ex.all_reduce == "shm"  # type: ignore[union-attr]
        tokens = lt.run(_greedy_tokens(engine), timeout=600)
        if kill_rank is not None:
            delays = lt.run(_kill_rank_while_streaming(engine, kill_rank), timeout=180)
            assert max(delays) < 2.0, f"streams failed {delays} s after the kill"
            assert f"worker {kill_rank}" in (engine.dead_reason or ""), engine.dead_reason
        lt.run(engine.shutdown(), timeout=60)
        assert all(p.poll() is not None for p in ex.procs)  # type: ignore[union-attr]
        assert our_segments() == before, "shared memory left behind"
        return tokens
    finally:
        try:
            lt.run(engine.shutdown(), timeout=60)
        finally:
            lt.close()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, real_source):
    """A random Llama with 4 heads and ONE KV head (replicated over 2 ranks), SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama_tp")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=real_source.config.vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    with torch.no_grad():  # larger weights than the init: logits far apart, no argmax ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.float().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_source.path / name).exists():
            shutil.copy(real_source.path / name, path / name)
    return str(path)


@pytest.mark.slow
def test_tp3_on_smollm2_gives_tp1_tokens_and_a_killed_rank_fails_requests_fast():
    one = _run_tp(None, 1)
    three = _run_tp(None, 3, kill_rank=2)
    assert all(len(t) == MAX_NEW for t in one)
    assert three == one


@pytest.mark.slow
def test_tp2_tiny_llama_with_a_replicated_kv_head_gives_tp1_tokens_and_survives_a_kill(tiny_llama):
    one = _run_tp(tiny_llama, 1)
    two = _run_tp(tiny_llama, 2, kill_rank=1)
    assert all(len(t) == MAX_NEW for t in one)
    assert len({tuple(t) for t in one}) == len(PROMPTS)  # the prompts lead to different answers
    assert two == one


def test_tp2_on_smollm2_is_refused_before_any_worker_starts():
    before = our_segments()
    lt = LoopThread()
    engine = AsyncEngine(tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            lt.run(engine.start(), timeout=120)
        msg = str(info.value)
        assert "tensor_parallel_size 2" in msg and "9 attention heads" in msg and "3 KV heads" in msg, msg
        assert "sizes that work: 1, 3" in msg, msg
        assert engine.executor is None  # refused before spawning anything
        assert time.monotonic() - t0 < 60
    finally:
        lt.run(engine.shutdown(), timeout=60)
        lt.close()
    assert our_segments() == before


_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.slow
@pytest.mark.skipif(_GPUS < 2, reason=f"needs CUDA with at least 2 GPUs ({_GPUS} visible)")
def test_tp2_on_cuda_gives_tp1_tokens(tiny_llama):
    async def tokens(tp: int) -> list[list[int]]:
        async with AsyncEngine(
            model=tiny_llama,
            tensor_parallel_size=tp,
            dtype="float32",
            device="cuda",
            max_model_len=1024,
            max_num_seqs=8,
        ) as engine:
            if tp > 1:
                assert engine.executor.all_reduce in ("symm_mem", "nccl")  # type: ignore[union-attr]
            return await _greedy_tokens(engine)

    assert asyncio.run(tokens(2)) == asyncio.run(tokens(1))


@pytest.mark.slow
def test_sigkilled_engine_leaves_no_segment_behind(tiny_llama):
    """The engine owns the all-reduce segment; if it is SIGKILLed, its ranks unlink it."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, sys, time; from aiolm import LLM; "
        "llm = LLM(model=sys.argv[1], tensor_parallel_size=2, dtype='float32', max_model_len=256, "
        "kv_cache_memory=16 << 20, num_threads=1); "
        "print(llm.engine.executor.all_reduce_shm, flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, tiny_llama],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        name = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert name.startswith(f"aiolm_{proc.pid}_") and os.path.exists(f"/dev/shm/{name}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _segments_of(proc.pid):
            time.sleep(0.1)
        assert not _segments_of(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"aiolm_{pid}_")]
