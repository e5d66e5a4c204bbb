"""aiolm imports and runs its CPU path where triton is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError, as where it is absent
import aiolm, aiolm.attention, aiolm.kernels.triton, aiolm.worker.cuda_graph, aiolm.worker.model_runner
from aiolm.kernels.triton import available
assert not available()
from aiolm.worker.cuda_graph import capture_sizes, plan_step
assert plan_step(3, 3, capture_sizes(8)).size == 4
try:
    import aiolm.attention.triton_backend
except ImportError:
    print("ok")
"""


def test_imports_without_triton():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
