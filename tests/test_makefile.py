"""`make`'s choice of torch build: said in one line, overridable, and refused when misspelt."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def _make(*args: str) -> subprocess.CompletedProcess:
    # BIN: the interpreter running these tests, so nothing new is installed anywhere else
    return subprocess.run(
        ["make", "--no-print-directory", *args, f"BIN={Path(sys.executable).parent}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_torch_build_is_chosen_and_said_in_one_line():
    import torch

    variant = "cuda" if torch.version.cuda else "cpu"
    out = _make("torch", f"TORCH_VARIANT={variant}")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("torch: ")]
    assert len(lines) == 2, out.stdout  # what is installed from where, then what is there
    assert ("CUDA build" if variant == "cuda" else "CPU build") in lines[0]
    assert lines[1] == f"torch: {torch.__version__} " + (
        f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    )


def test_cuda_variant_adds_triton_and_a_misspelt_one_is_refused():
    # `make serve` installs the runtime (plus triton on a GPU machine); `make test` adds the tools.
    dry = _make("-n", "-B", "install", "TORCH_VARIANT=cuda")
    assert dry.returncode == 0 and "-e '.[cuda]'" in dry.stdout and "test," not in dry.stdout, dry.stdout
    cpu = _make("-n", "-B", "install", "TORCH_VARIANT=cpu").stdout
    assert "-e '.'" in cpu and "[" not in cpu.split("-e ", 1)[1].split()[0], cpu
    assert "'.[test,bench,cuda]'" in _make("-n", "-B", "install-test", "TORCH_VARIANT=cuda").stdout
    assert "'.[test,bench]'" in _make("-n", "-B", "install-test", "TORCH_VARIANT=cpu").stdout
    bad = _make("torch", "TORCH_VARIANT=gpu")
    assert bad.returncode != 0 and "TORCH_VARIANT must be cpu or cuda, got 'gpu'" in bad.stderr
