"""Triton kernels for the GPU path: KV-cache write, paged attention, norms, RoPE, activations.

Nothing here imports triton at package import time: ``aiolm`` must import on machines
without it (macOS, aarch64, CPU-only installs). Import a kernel module (``attention``,
``cache``, ...) only after :func:`available` says yes.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors through triton's numpy
interpreter, which is how the tests check them against torch references without a GPU.
triton reads that variable when ``@triton.jit`` decorates a function, i.e. when a kernel
module is first imported, so it has to be set before that import.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """True where the triton package is installed (it may still lack a GPU to run on)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] set to None
        return False


def interpreting() -> bool:
    """True when triton runs kernels through its CPU interpreter."""
    from triton import knobs

    return bool(knobs.runtime.interpret)
