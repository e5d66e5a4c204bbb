"""Device helpers shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh through the sigmoid (not every triton build has tl.math.tanh); exact enough in
    float32. Clamped: tanh is 1 to float32 precision past |x| = 10, and exp stays finite."""
    x = tl.minimum(tl.maximum(x, -10.0), 10.0)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0
