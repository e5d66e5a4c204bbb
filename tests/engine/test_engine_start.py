"""An engine's start: its workers load the model while the engine loads the tokenizer, so a
tokenizer that fails to load must stop workers that are already running."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_harness import ENGINE_ARGS, LoopThread, our_segments

from aiolm import AsyncEngine
from aiolm.errors import ModelLoadError
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
