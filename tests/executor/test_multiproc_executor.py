"""MultiprocExecutor: worker processes, start-up handshake, RPC, death, clean shutdown.

These use a tiny random Qwen2 model saved to a temporary folder, so a worker
starts in seconds; greedy parity on the real model lives in
tests/worker/test_model_runner.py. After every executor shuts down the tests
check that its children are reaped (no ``aiolm.worker`` process left with this
process as parent) and that no ``/dev/shm/aiolm_<our pid>_*`` segment it created
remains.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import signal
import time

import pytest
import torch

from aiolm.config import RunnerConfig
from aiolm.core.request import Request
from aiolm.core.scheduler import Scheduler, SchedulerConfig
from aiolm.executor import ExecutorError
from aiolm.executor.multiproc import MultiprocExecutor
from aiolm.params import SamplingParams
from paged import hf_greedy
from procs import processes

BLOCK = 4
MAX_MODEL_LEN = 96
VOCAB = 512


# -- helpers ---------------------------------------------------------------------------


def _our_segments() -> set[str]:
    prefix = f"aiolm_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _worker_children() -> list[int]:
    """Live or zombie processes whose parent is us and that run aiolm.worker."""
    me = os.getpid()
    return [p.pid for p in processes() if p.ppid == me and (b"aiolm.worker" in p.cmdline or p.state == "Z")]


def _assert_clean(ex: MultiprocExecutor, segments_before: set[str]) -> None:
    for p in ex.procs:
        assert p.returncode is not None, f"worker pid {p.pid} not reaped"
    assert _worker_children() == []
    ring_names = {r.name for r in [ex.requests, *ex.responses] if r is not None}
    left = (_our_segments() - segments_before) | (ring_names & set(os.listdir("/dev/shm")))
    assert not left, f"shared memory left behind: {left}"


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen2 (4 heads, 2 KV heads: splits over 2 ranks) and its folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():  # larger weights than the init: logits far apart, no argmax ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model = model.float().eval()
    model.save_pretrained(path)
    return path, model


def _cfg(path, **kw) -> RunnerConfig:
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    return RunnerConfig(
        model=str(path), dtype="float32", max_num_seqs=8, block_size=BLOCK, kv_cache_memory=1 << 20, num_threads=1, **kw
    )


def _scheduler(ex) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=ex.num_blocks,
            block_size=BLOCK,
            max_num_seqs=8,
            max_num_batched_tokens=24,
            long_prefill_token_threshold=10,
            max_model_len=MAX_MODEL_LEN,
            hash_seed=0,
        )
    )


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _drive(ex, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Engine-style loop; request i arrives at step 2*i."""
    sched = _scheduler(ex)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while sched.has_unfinished_requests() or step < 2 * len(prompts):
        if step % 2 == 0 and step // 2 < len(prompts):
            sched.add_request(Request(str(step // 2), prompts[step // 2], _greedy(max_new)))
        so = sched.schedule()
        runner_output = await ex.execute(so)
        for o in sched.update_from_output(so, runner_output):
            assert o.error is None
            out[o.req_id].extend(o.new_token_ids)
        step += 1
        assert step < 500
    return [out[str(i)] for i in range(len(prompts))]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(9)]
    return [(shared if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(3, 25))] for i in range(n)]


def _one_step_output(req_id: str, prompt_len: int = 8):
    """The first step of a fresh scheduler holding one request: a full prefill."""
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=BLOCK, max_model_len=MAX_MODEL_LEN))
    sched.add_request(Request(req_id, list(range(1, prompt_len + 1)), _greedy(4)))
    return sched.schedule()


# -- start-up failures -----------------------------------------------------------------


def test_bad_model_path_fails_start_with_a_readable_error(tmp_path):
    before = _our_segments()
    missing = tmp_path / "no-such-model"
    ex = MultiprocExecutor(_cfg(missing), startup_timeout=120)
    t0 = time.monotonic()
    with pytest.raises(ExecutorError) as info:
        _run(ex.start())
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "worker 0" in msg and str(missing) in msg and "no such file" in msg, msg
    assert elapsed < 90, f"start took {elapsed:.0f}s to fail"
    _assert_clean(ex, before)
    _run(ex.shutdown())  # a second shutdown is harmless


def test_start_timeout_is_an_executor_error_and_cleans_up(tiny):
    before = _our_segments()
    ex = MultiprocExecutor(_cfg(tiny[0]), startup_timeout=0.2)  # no worker imports torch that fast
    with pytest.raises(ExecutorError, match="ready"):
        _run(ex.start())
    _assert_clean(ex, before)


@pytest.mark.slow
def test_tensor_parallel_over_indivisible_heads_fails_start_readably():
    """SmolLM2-135M has 9 attention heads: 2 ranks cannot split them."""
    before = _our_segments()
    ex = MultiprocExecutor(
        RunnerConfig(max_model_len=128, kv_cache_memory=32 << 20, num_threads=1), world_size=2, startup_timeout=300
    )
    with pytest.raises(ExecutorError, match="not divisible by tensor parallel size 2"):
        _run(ex.start())
    _assert_clean(ex, before)


# -- a worker dies -------------------------------------------------------------------------


def test_cancelled_call_then_worker_killed_mid_step(tiny):
    """A cancelled execute's late answer is not taken by the next call, nor are queued steps'
    answers by an rpc; then a SIGKILL
    during a step fails that step within 2 s, and every later call at once."""
    before = _our_segments()
    deaths: list[tuple[float, str]] = []
    ex = MultiprocExecutor(
        _cfg(tiny[0]), startup_timeout=120, on_death=lambda why: deaths.append((time.monotonic(), why))
    )

    def set_delay(runner, seconds):  # nested, so cloudpickle ships it by value
        import time as _time

        if not hasattr(runner, "_plain_execute"):
            runner._plain_execute = runner.execute

            def slow(so):
                _time.sleep(runner._delay)
                return runner._plain_execute(so)

            runner.execute = slow
        runner._delay = seconds
        return seconds

    async def scenario():
        await ex.start()
        try:
            infos = await ex.collective_rpc("kv_cache_info")
            assert infos == [{"num_blocks": ex.num_blocks, "block_size": BLOCK, "block_bytes": ex.block_bytes}]
            # 1. A caller gives up on a slow step; the worker still answers it later.
            assert await ex.collective_rpc(set_delay, (1.0,)) == [1.0]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ex.execute(_one_step_output("a")), 0.2)
            assert await ex.collective_rpc(set_delay, (0.0,)) == [0.0]  # not the stale step answer
            out = await ex.execute(_one_step_output("b"))
            assert out.req_ids == ["b"] and len(out.sampled_token_ids[0]) == 1
            # Two steps in flight (overlap scheduling submits before it reads) and an rpc behind
            # them: whoever reads first hands each reply to its own caller, in any order.
            first = await ex.submit(_one_step_output("e"))
            second = await ex.submit(_one_step_output("f"))
            assert await ex.collective_rpc("kv_cache_info") == infos
            assert (await ex.result(second)).req_ids == ["f"]
            assert (await ex.result(first)).req_ids == ["e"]
            # 2. SIGKILL while the worker is inside a step.
            await ex.collective_rpc(set_delay, (120.0,))
            task = asyncio.ensure_future(ex.execute(_one_step_output("c")))
            await asyncio.sleep(0.5)
            assert not task.done()  # the worker sleeps inside the step
            os.kill(ex.procs[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(ExecutorError, match="worker 0"):
                await asyncio.wait_for(task, 10)
            failed_after = time.monotonic() - killed
            assert failed_after < 2.0, failed_after
            assert deaths and deaths[0][0] - killed < 1.2, deaths
            assert not ex.is_alive()
            with pytest.raises(ExecutorError):  # and every later call fails at once
                await asyncio.wait_for(ex.execute(_one_step_output("d")), 1.0)
            with pytest.raises(ExecutorError):
                await asyncio.wait_for(ex.collective_rpc("kv_cache_info"), 1.0)
        finally:
            t0 = time.monotonic()
            await ex.shutdown()
            assert time.monotonic() - t0 < 5.0
        assert len(deaths) == 1

    _run(scenario())
    _assert_clean(ex, before)


def test_a_big_step_sent_while_a_big_reply_is_owed(tiny):
    """Overlap scheduling sends step 2 before it reads step 1's reply. Step 1's reply (whole-
    vocabulary prompt logprobs of long prompts) was bigger than its response ring, and step 2
    (a long allowed_token_ids list) bigger than the free request ring: the worker waited to
    write its reply, the engine to write step 2, each for the other, for good."""
    before = _our_segments()
    ex = MultiprocExecutor(_cfg(tiny[0], max_model_len=256), startup_timeout=120)
    sched = Scheduler(SchedulerConfig(num_blocks=128, block_size=BLOCK, max_num_batched_tokens=512, max_model_len=256))

    async def scenario():
        await ex.start()
        try:
            for i in range(2):
                prompt = [random.Random(i).randrange(VOCAB) for _ in range(200)]
                sched.add_request(Request(f"p{i}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=VOCAB)))
            first = await ex.submit(sched.schedule())
            allowed = [256 + i % 256 for i in range(3_000_000)]  # about 9 MB as the step carries them
            sched.add_request(Request("big", [1, 2, 3], SamplingParams(max_tokens=1, allowed_token_ids=allowed)))
            second = await asyncio.wait_for(ex.submit(sched.schedule()), 60)
            one = await asyncio.wait_for(ex.result(first), 60)
            assert one.req_ids == ["p0", "p1"] and len(one.prompt_logprobs["p0"].lists.token_ids) == 199
            two = await asyncio.wait_for(ex.result(second), 60)
            assert "big" in two.req_ids and 256 <= two.sampled_token_ids[two.req_ids.index("big")][0] < 512
        finally:
            await ex.shutdown()

    _run(scenario())
    _assert_clean(ex, before)


# -- tensor parallel: shared-memory all-reduce, and the gloo fallback ------------------------


@pytest.mark.slow
@pytest.mark.parametrize("all_reduce", ["shm", "gloo"])
def test_tensor_parallel_2_matches_one_rank_and_transformers_then_a_rank_dies(tiny, all_reduce):
    path, hf = tiny
    prompts = _prompts(4)
    max_new = 10
    want = [hf_greedy(hf, p, max_new) for p in prompts]
    before = _our_segments()

    async def one_rank():
        from aiolm.executor.local import LocalExecutor

        ex = LocalExecutor(_cfg(path))
        await ex.start()
        try:
            return await _drive(ex, prompts, max_new)
        finally:
            await ex.shutdown()

    assert _run(one_rank()) == want

    deaths: list[float] = []
    ex = MultiprocExecutor(
        _cfg(path),
        world_size=2,
        startup_timeout=180,
        on_death=lambda why: deaths.append(time.monotonic()),
        all_reduce=all_reduce,
    )

    async def two_ranks():
        await ex.start()
        try:
            assert ex.all_reduce == all_reduce
            assert (ex.all_reduce_shm is not None) == (all_reduce == "shm")
            infos = await ex.collective_rpc("kv_cache_info")
            assert len(infos) == 2 and all(i["block_size"] == BLOCK for i in infos)
            assert ex.num_blocks == min(i["num_blocks"] for i in infos)
            got = await _drive(ex, prompts, max_new)
            # A rank dies between steps: noticed by the monitor, then execute fails at once.
            os.kill(ex.procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            while not deaths and time.monotonic() - killed < 3:
                await asyncio.sleep(0.02)
            assert deaths and deaths[0] - killed < 1.2
            t0 = time.monotonic()
            with pytest.raises(ExecutorError, match="worker 1"):
                await asyncio.wait_for(ex.execute(_one_step_output("x")), 5)
            assert time.monotonic() - t0 < 2.0
            return got
        finally:
            t0 = time.monotonic()
            await ex.shutdown()  # rank 0 still runs: it must be told to go, not waited on
            assert time.monotonic() - t0 < 5.0

    assert _run(two_ranks()) == want
    _assert_clean(ex, before)


# -- the worker process's allocator ---------------------------------------------------------


def _heap_free_bytes() -> int:
    """The bytes in glibc's free chunks, over every arena (mallinfo2's fordblks)."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        ]

    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    return int(mallinfo2().fordblks)


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="glibc's mallopt")
def test_cpu_worker_reuses_freed_step_memory_and_the_callers_process_is_left_alone(tiny):
    """A CPU worker process keeps freed large allocations on its heap (CpuPlatform.
    tune_worker_process), so a step's big activations do not fault fresh pages in every
    step; the process that started it keeps glibc's defaults (a fresh mapping each time)."""

    # nested: cloudpickle ships it by value
    def faults_of_large_allocations(runner=None, nbytes: int = 64 << 20) -> list[int]:
        """Minor page faults while each of 6 tensors of ``nbytes`` is written, one after another."""
        import resource as _resource

        import torch as _torch

        faults = []
        for _ in range(6):
            before = _resource.getrusage(_resource.RUSAGE_SELF).ru_minflt
            _torch.ones(nbytes // 4).sum()
            faults.append(_resource.getrusage(_resource.RUSAGE_SELF).ru_minflt - before)
        return faults

    page = os.sysconf("SC_PAGE_SIZE")
    pages = (64 << 20) // page
    # glibc serves a request from its free chunks before it maps anything, whatever the size,
    # and after the suite's earlier tests this process's heap may hold more than 64 MiB free:
    # the probe here is larger than all of it, so only a mapping (glibc's default) can serve it
    probe = (_heap_free_bytes() + (64 << 20)) // page * page
    assert min(faults_of_large_allocations(nbytes=probe)) > probe // page // 2  # a fresh mapping each
    before = _our_segments()
    ex = MultiprocExecutor(_cfg(tiny[0]), startup_timeout=180)

    async def scenario():
        await ex.start()
        try:
            return await ex.collective_rpc(faults_of_large_allocations)
        finally:
            await ex.shutdown()

    [faults] = _run(scenario())
    # The first ones grow the heap (and a small allocation may pin a freed chunk), then most
    # pages are reused.
    assert min(faults) < pages // 4, (faults, pages)
    _assert_clean(ex, before)
