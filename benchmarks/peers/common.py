"""Shared by the peer runners: the same seeded workload aiolm uses, and the JSON result.

Runs inside each peer's own virtual environment, so it imports only numpy and the
standard library (it is loaded by path, not as part of aiolm).
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np


def workload(
    num: int = 64, plen: tuple[int, int] = (64, 256), olen: tuple[int, int] = (32, 128), seed: int = 0
) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    p = rng.integers(plen[0], plen[1] + 1, size=num)
    o = rng.integers(olen[0], olen[1] + 1, size=num)
    return [(rng.integers(100, 40001, size=int(a)).tolist(), int(b)) for a, b in zip(p, o)]


def report(peer: str, dtype: str, times: list[float], out_tokens: int, extra: dict | None = None) -> None:
    med = statistics.median(times)
    res = {
        "peer": peer,
        "dtype": dtype,
        "times_s": times,
        "median_s": med,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / med,
    }
    res.update(extra or {})
    print("RESULT " + json.dumps(res))
    sys.stdout.flush()
