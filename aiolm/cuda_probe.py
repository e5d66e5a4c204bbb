"""Is there a CUDA device for torch to use, asked without importing torch.

The engine process picks the device (``--device auto``) but runs no model, so it reads
the answer from files instead of loading torch and its CUDA runtime: whether the
installed torch was built with CUDA (its generated ``torch/version.py``) and whether
the NVIDIA driver shows a GPU to this process. The worker, which imports torch anyway,
checks again and fails with a clear error if CUDA still cannot start there.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "(not installed)"


def torch_cuda_build() -> bool:
    """Whether the installed torch was built with CUDA (``torch.version.cuda`` is set)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return False
    m = re.search(r"^cuda\b[^=\n]*=\s*(.+)$", text, re.MULTILINE)
    return m is not None and m.group(1).strip() != "None"


def gpu_visible() -> bool:
    """Whether the NVIDIA driver shows this process a GPU (CUDA_VISIBLE_DEVICES honoured)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"))
