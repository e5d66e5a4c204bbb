"""Which all-reduce runs: the choice rules everywhere, the CUDA group where 2+ GPUs exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiolm.config import EngineArgs
from aiolm.distributed.communicator import ENV_VAR, check_for_device, make_tp_group, requested_all_reduce

ROOT = Path(__file__).resolve().parents[2]


def test_the_environment_overrides_only_auto(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "gloo")
    assert requested_all_reduce("auto") == "gloo"
    assert requested_all_reduce("shm") == "shm"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="'bogus' is not supported"):
        requested_all_reduce("auto")


def test_choices_the_device_cannot_run_are_refused():
    with pytest.raises(ValueError, match="'shm' does not run on cuda"):
        check_for_device("shm", "cuda")
    with pytest.raises(ValueError, match="'nccl' does not run on cpu"):
        check_for_device("nccl", "cpu")
    check_for_device("auto", "cpu")
    with pytest.raises(ValueError, match="all_reduce"):
        EngineArgs(all_reduce="mpi")


def test_one_rank_has_no_all_reduce_and_shm_without_a_segment_is_an_error():
    group, name = make_tp_group(0, 1, "cpu", "shm")
    assert name == "none" and group.world_size == 1
    x = torch.ones(3)
    assert group.all_reduce(x) is x
    with pytest.raises(RuntimeError, match="no shared segment"):
        make_tp_group(0, 2, "cpu", "shm", shm_name=None)


_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_GPUS < 2, reason=f"needs CUDA with at least 2 GPUs ({_GPUS} visible)")
def test_cuda_all_reduce_matches_nccl_on_every_rank():
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu/allreduce_check.py", "--ranks", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "allreduce_check: ok" in out.stdout
    assert "all-reduce in use: symm_mem" in out.stdout or "all-reduce in use: nccl" in out.stdout
