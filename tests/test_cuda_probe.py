"""aiolm/cuda_probe.py answers from files what torch would answer, so the engine process
can pick its device without importing torch."""

from __future__ import annotations

import torch

from aiolm import cuda_probe
from aiolm.config import EngineArgs


def test_the_probe_agrees_with_torch():
    assert cuda_probe.torch_cuda_build() == (torch.version.cuda is not None)
    assert cuda_probe.torch_version() == torch.__version__
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineArgs(device="auto").resolved_device() == expected


def test_hidden_gpus_mean_the_cpu(monkeypatch):
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert not cuda_probe.gpu_visible()
        assert EngineArgs(device="auto").resolved_device() == "cpu"
    assert EngineArgs(device="cpu").resolved_device() == "cpu"
