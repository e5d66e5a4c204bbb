"""An engine's start: its workers load the model while the engine loads the tokenizer, so a
tokenizer that fails to load must stop workers that are already running; and they build the
grammar compiler only once grammars are in use."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from engine_harness import ENGINE_ARGS, LoopThread, our_segments

from aiolm import AsyncEngine, SamplingParams
from aiolm.errors import ModelLoadError
from aiolm.structured.spec import StructuredOutputs
from procs import live_running

pytestmark = pytest.mark.slow


def _folder_with_tokenizer(real_source, tmp_path: Path, tokenizer_json: bytes) -> Path:
    """The embedded model's converted folder, linked file by file, with ``tokenizer_json`` in
    place of its tokenizer."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in real_source.path.iterdir():
        if f.name == "tokenizer.json":
            (folder / f.name).write_bytes(tokenizer_json)
        else:
            (folder / f.name).symlink_to(f)
    return folder


def test_a_broken_tokenizer_fails_the_start_and_leaves_no_worker(real_source, tmp_path):
    folder = _folder_with_tokenizer(real_source, tmp_path, b'{"model": {"type": "nothing we know"')
    before = our_segments()
    lt = LoopThread()
    engine = AsyncEngine(model=str(folder), **ENGINE_ARGS)
    try:
        with pytest.raises(ModelLoadError, match="cannot load tokenizer") as caught:
            lt.run(engine.start(), timeout=300)
        assert str(folder) in str(caught.value)
        # the workers were started beside the tokenizer's load, and are gone with their rings
        ex = engine.executor
        assert ex is not None and ex.procs, "the workers should have started beside the tokenizer"
        assert all(p.poll() is not None for p in ex.procs)
        assert live_running(b"aiolm.worker", os.getpid()) == []
        assert our_segments() == before
    finally:
        lt.run(engine.shutdown(), timeout=60)
        lt.close()


def test_workers_build_the_grammar_compiler_once_grammars_are_in_use():
    """Not while loading, so a start without grammars never pays for it; once the first
    grammar's check begins the workers build it, and a replacement worker set builds it at
    once, before any grammar of its own."""

    def compiler_built(runner) -> bool:  # nested, so cloudpickle ships it by value
        from aiolm.structured.backend import Compiler

        return Compiler._compiler is not None

    async def built_within(engine: AsyncEngine, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await engine.executor.collective_rpc(compiler_built) == [True]:
                return True
            await asyncio.sleep(0.2)
        return False

    async def answer(engine: AsyncEngine, pattern: str) -> str:
        params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputs("regex", pattern))
        final = None
        async for out in engine.generate("Is the sky blue? Answer:", params):
            final = out
        assert final is not None
        return final.outputs[0].text

    async def replaced(engine: AsyncEngine, old: object, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while engine.executor is old or not engine.is_healthy():
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            await asyncio.sleep(0.1)

    lt = LoopThread()
    engine = AsyncEngine(**ENGINE_ARGS)
    try:
        lt.run(engine.start(), timeout=300)
        assert lt.run(engine.executor.collective_rpc(compiler_built), timeout=30) == [False]
        assert lt.run(answer(engine, "(yes|no)"), timeout=120) in ("yes", "no")
        assert lt.run(built_within(engine, 60), timeout=90)
        old = engine.executor
        os.kill(old.procs[0].pid, signal.SIGKILL)
        lt.run(replaced(engine, old), timeout=150)
        assert lt.run(built_within(engine, 60), timeout=90), "the replacement workers did not build it"
        assert lt.run(answer(engine, "(maybe|perhaps)"), timeout=120) in ("maybe", "perhaps")
    finally:
        lt.run(engine.shutdown(), timeout=60)
        lt.close()


def test_generation_config_sampling_defaults(real_source, tmp_path):
    """A model's generation_config.json recommendations are what LLM.generate samples with
    when given no params (vLLM's --generation-config auto); --generation-config vllm keeps
    the API's defaults. The greedy recommendation here makes the first visibly greedy."""
    import json

    from aiolm import LLM
    from aiolm.config import EngineArgs

    folder = _folder_with_tokenizer(real_source, tmp_path, (real_source.path / "tokenizer.json").read_bytes())
    (folder / "generation_config.json").unlink()
    gen = {**real_source.generation_config, "temperature": 0.0, "top_k": 0, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    args = {k: v for k, v in ENGINE_ARGS.items() if k != "model"}
    with LLM(str(folder), **args) as llm:
        assert llm.get_default_sampling_params().temperature == 0.0
        (free,) = llm.generate("The capital of France is", use_tqdm=False)
        (greedy,) = llm.generate("The capital of France is", SamplingParams(temperature=0.0), use_tqdm=False)
        assert free.outputs[0].token_ids == greedy.outputs[0].token_ids
    lean = AsyncEngine(EngineArgs(model=str(folder), generation_config="vllm", **args))
    asyncio.run(lean.load_model())
    assert lean.sampling_defaults == {} and lean.generation_config["temperature"] == 0.0
