"""Random GGUF k-quant blocks (Q4_K, Q6_K) for tests: gguf-py dequantizes k-quants but cannot
quantize them, and any 6-bit scale and min, int8 scale and 4- or 6-bit code is a valid block,
so blocks are drawn from random bytes with the scales set to a chosen range."""

from __future__ import annotations

import numpy as np


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(v.shape + (2,))


def random_q4_k(rows: int, cols: int, rng: np.random.Generator, d: tuple[float, float]) -> np.ndarray:
    """Random Q4_K rows (uint8 [rows, cols / 256 * 144]): d log-uniform in ``d``, dmin 7.5x
    such a draw (a sub-block's mean d * sc * 7.5 - dmin * m is then centred on 0 on average),
    random scale/min bytes and nibbles."""
    n = rows * cols // 256
    b = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    b[:, 0:2] = _f16_bytes(np.exp(rng.uniform(*np.log(d), n)))
    b[:, 2:4] = _f16_bytes(7.5 * np.exp(rng.uniform(*np.log(d), n)))
    return b.reshape(rows, -1)


def random_q6_k(rows: int, cols: int, rng: np.random.Generator, d: tuple[float, float]) -> np.ndarray:
    """Random Q6_K rows (uint8 [rows, cols / 256 * 210]): d log-uniform in ``d``, random
    codes and int8 scales (-128 included)."""
    n = rows * cols // 256
    b = rng.integers(0, 256, (n, 210), dtype=np.uint8)
    b[:, 208:210] = _f16_bytes(np.exp(rng.uniform(*np.log(d), n)))
    return b.reshape(rows, -1)
