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


@triton.jit
def fp8_e4m3_scaled_half(b):
    """float8 e4m3 bytes (uint8) as float16 holding value / 256, exactly: the byte's bits
    moved into a float16's, whose exponent bias is 8 more. Half-precision dots take this."""
    w = b.to(tl.uint16)
    return (((w & 0x80) << 8) | ((w & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def fp8_e4m3_float(b):
    """float8 e4m3 bytes (uint8) as their float32 values, exactly. (One function per result
    type: compiled Triton rejects a function whose returns differ in type, even behind a
    constexpr branch, which the interpreter accepts.)"""
    return fp8_e4m3_scaled_half(b).to(tl.float32) * 256.0
