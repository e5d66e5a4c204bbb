"""The worker's KV-cache sizing on the CUDA platform and its "does not fit" errors, on a CPU.

No GPU can exist here, so torch.cuda's memory queries are replaced by a scripted GPU (the
one mock this suite allows). The profile itself is real: the embedded model runs the
largest prefill and decode steps on the CPU, through the same code a GPU worker runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aiolm.config import RunnerConfig
from aiolm.worker.kv_cache_size import KVCacheSizer

GiB = 2**30


class ScriptedGpu:
    """torch.cuda's memory queries: fixed sizes, and the allocator's counters as the
    profile reads them in turn (weights, then before the decode step)."""

    def __init__(self, total: int, allocated: list[int], peaks: list[int], free: list[int], reserved: int):
        self.total, self.allocated, self.peaks, self.free, self.reserved = total, allocated, peaks, free, reserved

    def install(self, monkeypatch) -> None:
        c = torch.cuda
        monkeypatch.setattr(c, "is_available", lambda: True)
        monkeypatch.setattr(c, "device_count", lambda: 1)
        monkeypatch.setattr(c, "set_device", lambda d: None)
        monkeypatch.setattr(c, "current_device", lambda: 0)
        monkeypatch.setattr(c, "empty_cache", lambda: None)
        monkeypatch.setattr(c, "synchronize", lambda d=None: None)
        monkeypatch.setattr(c, "reset_peak_memory_stats", lambda d=None: None)
        monkeypatch.setattr(c, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=self.total))
        monkeypatch.setattr(c, "memory_allocated", lambda d=None: self.allocated.pop(0))
        monkeypatch.setattr(c, "max_memory_allocated", lambda d=None: self.peaks.pop(0))
        monkeypatch.setattr(c, "memory_reserved", lambda d=None: self.reserved)
        monkeypatch.setattr(c, "mem_get_info", lambda d=None: (self.free.pop(0), self.total))


@pytest.fixture
def runner(real_model):
    """What kv_cache_bytes reads of a ModelRunner; the model runs on the CPU."""
    mc = real_model.config
    cfg = RunnerConfig(max_num_batched_tokens=32, max_model_len=64, max_num_seqs=4, gpu_memory_utilization=0.5)
    return SimpleNamespace(
        cfg=cfg,
        device=torch.device("cpu"),
        model=real_model,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        kv_dtype=torch.float32,
        uses_cuda_graphs=lambda: True,
    )


def _scratch(runner) -> int:
    """Bytes of the profile's scratch cache: 32 tokens in pages of 16, plus the null page."""
    per_block = 2 * 16 * runner.num_kv_heads * runner.head_dim * 4
    return 3 * per_block * runner.num_layers


def _platform(monkeypatch, gpu: ScriptedGpu):
    from aiolm.platforms.cuda import CudaPlatform

    gpu.install(monkeypatch)
    return CudaPlatform()


def test_kv_cache_gets_what_is_left_of_the_fraction(monkeypatch, runner, caplog):
    s = _scratch(runner)
    w = 10 * GiB
    # 5 GiB in use by others when the rank took its GPU; later 2 GiB more outside torch
    # (context, libraries): total - free - reserved = 5 + 2
    gpu = ScriptedGpu(
        total=80 * GiB,
        allocated=[w, w + s],
        peaks=[w + s + 3 * GiB, w + s + GiB // 2, w + s + GiB],
        free=[75 * GiB, 80 * GiB - 20 * GiB - 7 * GiB, 50 * GiB],
        reserved=20 * GiB,
    )
    platform = _platform(monkeypatch, gpu)
    assert platform.worker_device("cuda", 0) == torch.device("cuda", 0)
    platform.worker_device("cuda", 0)  # a second call (ModelRunner's) keeps the first measurement
    with caplog.at_level("INFO", logger="aiolm.worker.kv_cache_size"):
        kv = KVCacheSizer(platform).kv_cache_bytes(runner)
    # 40 GiB budget - (10 weights + 3 prefill activations) - 2 outside torch - 2 x 0.5 graph pool
    assert kv == 40 * GiB - 13 * GiB - 2 * GiB - GiB
    assert "KV cache 24.00 GiB" in caplog.text and "CUDA graphs 1.00 GiB" in caplog.text
    assert gpu.allocated == gpu.peaks == gpu.free == []  # every query the profile makes was scripted


def test_without_graphs_and_without_a_baseline(monkeypatch, runner):
    """enforce_eager: no graph pool; kv_cache_bytes before worker_device counts all memory
    in use outside torch, other processes' included."""
    s = _scratch(runner)
    w = 10 * GiB
    gpu = ScriptedGpu(
        total=80 * GiB,
        allocated=[w, w + s],
        peaks=[w + s + 3 * GiB, w + s, w + s + GiB],
        free=[80 * GiB - 20 * GiB - 7 * GiB, 50 * GiB],
        reserved=20 * GiB,
    )
    platform = _platform(monkeypatch, gpu)
    runner.uses_cuda_graphs = lambda: False
    assert KVCacheSizer(platform).kv_cache_bytes(runner) == 40 * GiB - 13 * GiB - 7 * GiB


def test_weights_larger_than_the_fraction(monkeypatch, runner):
    gpu = ScriptedGpu(total=80 * GiB, allocated=[50 * GiB], peaks=[], free=[], reserved=50 * GiB)
    platform = _platform(monkeypatch, gpu)
    with pytest.raises(ValueError) as e:
        KVCacheSizer(platform).kv_cache_bytes(runner)
    msg = str(e.value)
    assert "--gpu-memory-utilization 0.5" in msg and "50.00 GiB" in msg and "40.00 GiB" in msg
    assert "kv_cache_memory" not in msg


def test_no_room_left_for_the_kv_cache(monkeypatch, runner):
    s = _scratch(runner)
    w = 30 * GiB
    gpu = ScriptedGpu(
        total=80 * GiB, allocated=[w, w + s], peaks=[w + s + 12 * GiB, w + s, w + s], free=[38 * GiB], reserved=42 * GiB
    )
    platform = _platform(monkeypatch, gpu)
    with pytest.raises(ValueError) as e:
        KVCacheSizer(platform).kv_cache_bytes(runner)
    msg = str(e.value)
    assert "no room is left for the KV cache" in msg
    assert "--gpu-memory-utilization 0.5" in msg and "weights 30.00 GiB" in msg and "activation peak 12.00 GiB" in msg


def test_other_processes_leave_too_little_free(monkeypatch, runner):
    s = _scratch(runner)
    w = 10 * GiB
    gpu = ScriptedGpu(
        total=80 * GiB,
        allocated=[w, w + s],
        peaks=[w + s + GiB, w + s, w + s],
        free=[20 * GiB, 80 * GiB - 50 * GiB - 10 * GiB, 10 * GiB],
        reserved=10 * GiB,
    )
    platform = _platform(monkeypatch, gpu)
    platform.worker_device("cuda", 0)  # 60 GiB held by another process
    with pytest.raises(ValueError) as e:
        KVCacheSizer(platform).kv_cache_bytes(runner)
    msg = str(e.value)
    assert "only 10.00 GiB" in msg and "other processes hold 60.00 GiB" in msg and "--gpu-memory-utilization" in msg


def test_too_few_blocks_names_the_knob_of_each_platform(monkeypatch):
    from aiolm.platforms.cpu import CpuPlatform

    cfg = RunnerConfig(max_model_len=4096, gpu_memory_utilization=0.3)
    assert "raise kv_cache_memory" in KVCacheSizer(CpuPlatform()).too_few_blocks(cfg, 10, 257)
    platform = _platform(monkeypatch, ScriptedGpu(80 * GiB, [], [], [], 0))
    msg = KVCacheSizer(platform).too_few_blocks(cfg, 10, 257)
    assert "kv_cache_memory" not in msg
    assert "--gpu-memory-utilization" in msg and "--max-model-len" in msg and "10 blocks" in msg


def test_out_of_memory_becomes_a_clear_error(monkeypatch):
    platform = _platform(monkeypatch, ScriptedGpu(80 * GiB, [], [], [70 * GiB], 9 * GiB))
    cfg = RunnerConfig(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError) as e:
        with platform.memory_guard("loading the weights", cfg):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    msg = str(e.value)
    assert msg.startswith("the model does not fit on cuda:0: loading the weights ran out of GPU memory")
    assert "--gpu-memory-utilization 0.9" in msg and "9.00 GiB" in msg and "70.00 GiB of 80.00 GiB" in msg
    assert "Tried to allocate 2.00 GiB" in msg
    with pytest.raises(KeyError):  # anything else goes through untouched
        with platform.memory_guard("loading the weights", cfg):
            raise KeyError("x")


def test_data_parallel_replicas_take_disjoint_gpus(monkeypatch):
    """Under --data-parallel-size, replica i's rank r runs on cuda:<i * tp + r>: each replica
    process's engine (replica_engine, what replica.py runs) gives its workers a device_offset
    (read here from the RunnerConfig it hands its executor, which cannot start GPU workers on
    this machine); past the visible GPUs the error says why. A Ray replica counts from 0: Ray
    shows its actor only the GPUs of its bundle."""
    import asyncio
    import dataclasses

    from aiolm.config import EngineArgs
    from aiolm.engine.async_engine import AsyncEngine
    from aiolm.engine.replica import replica_engine
    from aiolm.platforms.cuda import CudaPlatform

    handed = []

    async def no_executor(self, cfg, attempt):
        handed.append(cfg)
        raise RuntimeError("no GPU workers here")

    monkeypatch.setattr(AsyncEngine, "_make_executor", no_executor)
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=3, max_model_len=64)
    for i in range(2):
        with pytest.raises(RuntimeError, match="no GPU workers"):
            asyncio.run(replica_engine(args, i).start())
    assert [c.device_offset for c in handed] == [0, 3]
    on_ray = dataclasses.replace(args, data_parallel_backend="ray")
    with pytest.raises(RuntimeError, match="no GPU workers"):
        asyncio.run(replica_engine(on_ray, 1).start())
    assert handed.pop().device_offset == 0

    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 6)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (GiB, 2 * GiB))
    platform = CudaPlatform()
    devices = [platform.worker_device("cuda", c.device_offset + rank) for c in handed for rank in range(3)]
    assert devices == [torch.device("cuda", i) for i in range(6)] == picked
    with pytest.raises(ValueError, match="needs GPU 6 .* only 6 are visible"):
        platform.worker_device("cuda", 6)
    assert platform.worker_device("cuda:1", 4) == torch.device("cuda", 1)  # an explicit index stays
