"""Fixtures shared by the engine tests' modules."""

from __future__ import annotations

import pytest
from engine_harness import RAY_ARGS, RAY_MAX_NEW, RAY_PROMPTS, LoopThread


@pytest.fixture(scope="session")
def ray_reference() -> list[list[int]]:
    """The Ray tests' greedy tokens from the local executor, computed once for both modules."""
    from aiolm import AsyncEngine, SamplingParams

    async def greedy(engine: AsyncEngine) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=RAY_MAX_NEW, ignore_eos=True)
        tokens = []
        for prompt in RAY_PROMPTS:
            final = None
            async for out in engine.generate(prompt, params):
                final = out
            assert final is not None
            tokens.append(list(final.outputs[0].token_ids))
        return tokens

    lt = LoopThread()
    engine = AsyncEngine(executor="local", **RAY_ARGS)
    try:
        lt.run(engine.start(), timeout=600)
        return lt.run(greedy(engine), timeout=600)
    finally:
        lt.run(engine.shutdown(), timeout=60)
        lt.close()
