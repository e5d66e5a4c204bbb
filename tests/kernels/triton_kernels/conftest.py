"""Run the Triton kernels on CUDA where there is a GPU, else through triton's CPU interpreter.

triton decides interpreter-or-not when ``@triton.jit`` decorates a kernel, i.e. when a
kernel module is first imported, so TRITON_INTERPRET is set here, before any test module
of this directory imports one (they import kernels inside tests and fixtures only).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = HAVE_TRITON and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if HAVE_TRITON and not ON_GPU:
    _early = [m for m in sys.modules if m.startswith("aiolm.kernels.triton.")]
    if _early:
        raise RuntimeError(
            f"{_early} imported before TRITON_INTERPRET=1 was set: their kernels "
            f"were built for a GPU; run this directory in its own pytest process"
        )
    os.environ["TRITON_INTERPRET"] = "1"

collect_ignore_glob = [] if HAVE_TRITON else ["test_*.py"]


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if ON_GPU else "cpu"
