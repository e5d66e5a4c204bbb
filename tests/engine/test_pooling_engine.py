"""A decoder as an embedding model (--runner pooling) through the whole engine: worker
processes, the scheduler splitting prompts over steps and preempting them, and the
requests ending with their vector and their blocks back in the pool.

The embedded SmolLM2 pools its last token (a folder without modules.json) and, through a
sentence-transformers modules.json beside the same weights, the mean of its tokens; both
equal transformers' final hidden states pooled the same way, at the same time as prompts
run in chunks of 16 tokens through a KV cache too small to hold them all.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from engine_harness import ENGINE_ARGS, LoopThread

from aiolm import AsyncEngine, ParamError, PoolingParams
from aiolm.config import EngineArgs

LENGTHS = (5, 23, 40, 61, 90, 120, 150)
# 16 tokens per step splits every long prompt; 20 blocks of 16 tokens cannot hold the seven
# prompts at once (489 tokens need 34 blocks), so they wait, and growing ones preempt others.
CHUNKED = dict(ENGINE_ARGS, max_model_len=256, max_num_batched_tokens=16)
KV_BLOCK_BYTES = 2 * 16 * 3 * 64 * 30 * 4  # SmolLM2-135M: 30 layers of 3 KV heads of 64, float32


def _prompts(vocab: int) -> list[list[int]]:
    """Random prompts; the longer ones share their first 32 tokens (two full blocks a later
    request can find in the prefix cache)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(100, vocab - 1, (32,), generator=g).tolist()
    out = []
    for n in LENGTHS:
        ids = torch.randint(100, vocab - 1, (n,), generator=g).tolist()
        out.append(shared + ids[32:] if n > 40 else ids)
    return out


def _reference(hf, prompts: list[list[int]], kind: str) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
            v = h[-1] if kind == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0))
    return out


def _cos(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


@pytest.fixture(scope="module")
def mean_folder(tmp_path_factory, real_source):
    """The embedded model's folder as a sentence-transformers embedder pooling by the mean."""
    path = tmp_path_factory.mktemp("smollm_mean")
    for f in real_source.path.iterdir():
        (path / f.name).symlink_to(f)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": real_source.config.hidden_size, "pooling_mode_mean_tokens": True})
    )
    return str(path)


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


async def _embed_all(engine: AsyncEngine, prompts: list[list[int]], **kw) -> list[list[float]]:
    async def one(ids: list[int]) -> list[float]:
        async for out in engine.encode(ids, PoolingParams(**kw)):
            return out.outputs.embedding
        raise AssertionError("no output")

    return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_pooled_decoder_equals_transformers_with_chunks_and_preemption(
    kind, loop, real_source, hf_reference, mean_folder
):
    model = str(real_source.origin) if kind == "last" else mean_folder
    prompts = _prompts(real_source.config.vocab_size)
    ref = _reference(hf_reference, prompts, kind)

    async def go():
        args = EngineArgs(model=model, runner="pooling", **dict(CHUNKED, kv_cache_memory=20 * KV_BLOCK_BYTES))
        async with AsyncEngine(args) as engine:
            assert engine.runner == "pooling" and engine.pooling_config.pooling_type == kind
            got = await _embed_all(engine, prompts)
            one_by_one = [(await _embed_all(engine, [p]))[0] for p in prompts[:2]]
            # the shared prefix again, now certainly cached (when caching is on)
            again = (await _embed_all(engine, [prompts[-1]]))[0]
            free = engine.scheduler.num_free_blocks
            total = engine.scheduler.kv_cache_manager.num_usable_blocks
            return got, one_by_one, again, engine.scheduler.prefix_cache_stats.hits, free, total

    got, one_by_one, again, hits, free, total = loop.run(go(), timeout=300)
    # last-token pooling reuses cached prefix blocks; the mean needs every token's state
    assert (hits > 0) == (kind == "last")
    assert max(abs(x - y) for x, y in zip(again, got[-1])) < 1e-5
    for g, r in zip(got, ref):
        assert abs(math.sqrt(sum(x * x for x in g)) - 1.0) < 1e-5  # normalised
        assert _cos(g, r) >= 0.99999
    for a, b in zip(one_by_one, got):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert free == total  # every finished request gave its blocks back


def test_pooling_engine_refuses_what_it_cannot_do(loop, real_source):
    """Bad input names the field; generation on a pooling engine is refused, and pooling on a
    generating one."""

    async def go():
        errors = {}
        args = EngineArgs(runner="pooling", **ENGINE_ARGS)
        async with AsyncEngine(args) as engine:
            cases = {
                "empty": ("", PoolingParams()),
                "vocab": ([1, real_source.config.vocab_size], PoolingParams()),
                "long": ([5] * 1025, PoolingParams()),
                "dimensions": ([5, 6], PoolingParams(dimensions=8)),
                "task": ([5, 6], PoolingParams(task="classify")),
                # token types given in the params: checked as the prompt's are (they crashed workers)
                "types": ([5, 6], PoolingParams(token_type_ids=[5, 0])),
                "types length": ([5, 6], PoolingParams(token_type_ids=[1])),
                "types twice": (
                    {"prompt_token_ids": [5, 6], "token_type_ids": [0, 1]},
                    PoolingParams(token_type_ids=[0, 1]),
                ),
                "decoder types": ({"prompt_token_ids": [5, 6], "token_type_ids": [0, 1]}, PoolingParams()),
            }
            for name, (prompt, params) in cases.items():
                try:
                    async for _ in engine.encode(prompt, params):
                        pass
                except ParamError as e:
                    errors[name] = (e.param, str(e))
            try:
                async for _ in engine.generate("hi"):
                    pass
            except ParamError as e:
                errors["generate"] = (e.param, str(e))
            # truncation instead of refusal, when asked
            async for out in engine.encode([5] * 1100, truncate_prompt_tokens=-1):
                errors["truncated_len"] = len(out.prompt_token_ids)
        async with AsyncEngine(EngineArgs(**ENGINE_ARGS)) as engine:
            try:
                async for _ in engine.encode("hi"):
                    pass
            except ParamError as e:
                errors["pool_on_generate"] = (e.param, str(e))
        return errors

    errors = loop.run(go(), timeout=300)
    assert errors["empty"][0] == "input" and "empty" in errors["empty"][1]
    assert errors["vocab"][0] == "input" and "outside the vocabulary" in errors["vocab"][1]
    assert errors["long"][0] == "input" and "at most 1024" in errors["long"][1]
    assert errors["dimensions"][0] == "dimensions" and "matryoshka" in errors["dimensions"][1]
    assert errors["task"][0] == "model"
    assert errors["generate"][0] == "model" and "--runner pooling" in errors["generate"][1]
    assert errors["pool_on_generate"][0] == "model" and "--runner pooling" in errors["pool_on_generate"][1]
    assert errors["truncated_len"] == 1024
    # a decoder has no token types: they reached its forward and failed the workers
    assert [errors[k][0] for k in ("types", "types length", "types twice", "decoder types")] == ["token_type_ids"] * 4
    assert "takes no token type ids" in errors["decoder types"][1]
    with pytest.raises(ParamError, match="task"):
        PoolingParams(task="generate")
    for bad, field in ((dict(normalize="yes"), "normalize"), (dict(dimensions=2.5), "dimensions")):
        with pytest.raises(ParamError) as e:
            PoolingParams(**bad)
        assert e.value.param == field


def test_matryoshka_dimensions_cut_then_normalise(tmp_path, loop, real_source, hf_reference):
    """A config that says ``matryoshka_dimensions`` lets a request keep the first N values of
    the embedding (normalised after the cut, as vLLM does); other sizes are refused."""
    for f in real_source.path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((real_source.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, matryoshka_dimensions=[64, 128])))
    ids = _prompts(real_source.config.vocab_size)[2]
    with torch.inference_mode():
        full = hf_reference.model(torch.tensor([ids])).last_hidden_state[0, -1].float()

    async def go():
        async with AsyncEngine(EngineArgs(model=str(tmp_path), runner="pooling", **ENGINE_ARGS)) as engine:
            cut = (await _embed_all(engine, [ids], dimensions=64))[0]
            raw = (await _embed_all(engine, [ids], normalize=False))[0]
            try:
                await _embed_all(engine, [ids], dimensions=100)
            except ParamError as e:
                return cut, raw, str(e)
            return cut, raw, None

    cut, raw, refused = loop.run(go(), timeout=300)
    assert len(cut) == 64 and _cos(cut, torch.nn.functional.normalize(full[:64], dim=0)) >= 0.99999
    assert abs(math.sqrt(sum(x * x for x in cut)) - 1.0) < 1e-5
    assert len(raw) == full.numel() and max(abs(a - float(b)) for a, b in zip(raw, full)) < 1e-3
    assert refused is not None and "64, 128" in refused
