"""Fixtures shared by the engine tests' modules."""

from __future__ import annotations

import pytest
from engine_harness import RAY_ARGS, RAY_MAX_NEW, RAY_PROMPTS, LoopThread, greedy_streams


@pytest.fixture(scope="session")
def ray_reference() -> list[list[int]]:
    """The Ray tests' greedy tokens from the local executor, computed once for both modules."""
    from aiolm import AsyncEngine

    lt = LoopThread()
    engine = AsyncEngine(executor="local", **RAY_ARGS)
    try:
        lt.run(engine.start(), timeout=600)
        return lt.run(greedy_streams(engine, RAY_PROMPTS, RAY_MAX_NEW), timeout=600)
    finally:
        lt.run(engine.shutdown(), timeout=60)
        lt.close()
