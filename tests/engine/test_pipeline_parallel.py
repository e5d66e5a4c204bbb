"""Pipeline parallelism end to end: stages of real worker processes linked by shared memory.

PP=2 on the embedded SmolLM2 (30 layers: 15 a stage) must give one rank's greedy tokens in
float32 while prompts are chunked (32-token steps), a shared prefix is read from the prefix
cache and the small per-stage KV cache forces preemptions; the stages' own trace must show
both computing at once; and a SIGKILLed last stage is replaced with the whole worker set
while the streams go on, each ending with the tokens of a fault-free run. A tiny random
Qwen3 split PP=2 and TP=2 x PP=2, and a tiny Qwen3-MoE split PP=2, must give
transformers' greedy tokens.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from engine_harness import LoopThread, greedy_streams, our_segments, overlap_s

from aiolm import LLM, AsyncEngine, EngineArgs, SamplingParams
from aiolm.distributed.stages import stage_layers
from moe_models import moe_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "List three colours:",
    "The theory of relativity says that",
    "import numpy as np\n",
    "Dear diary, today I",
    "A haiku about the sea:",
]
# two prompts that share their first three blocks: the second one's prefill hits the cache
SHARED = "You are a careful assistant. Answer in one short sentence, and do not repeat the question. "
PROMPTS += [SHARED + "What is the tallest mountain?", SHARED + "Why is the sky blue?"]
MAX_NEW = 40
ARGS = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=32, num_threads=1, dtype="float32")


def _greedy(engine: AsyncEngine, started: asyncio.Event | None = None):
    return greedy_streams(engine, PROMPTS, MAX_NEW, started, after=8)


def test_layers_split_evenly_into_stages():
    assert [stage_layers(30, r, 2) for r in range(2)] == [range(0, 15), range(15, 30)]
    assert [list(stage_layers(7, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="cannot be split into 4 pipeline stages"):
        stage_layers(3, 0, 4)


@pytest.mark.parametrize(
    "over, why",
    [
        (dict(executor="local"), "executor mp"),
        (dict(async_scheduling=True), "async-scheduling"),
        (dict(speculative="ngram"), "speculative"),
        (dict(enable_lora=True), "LoRA"),
        (dict(pipeline_parallel_size=0), "must be >= 1"),
    ],
)
def test_what_a_pipeline_does_not_run_is_refused_by_name(over, why):
    with pytest.raises(ValueError, match=why):
        EngineArgs(**{"pipeline_parallel_size": 2, **over})


@pytest.mark.slow
def test_pp2_matches_one_rank_overlaps_its_stages_and_survives_a_killed_stage():
    lt = LoopThread()
    try:
        one = AsyncEngine(**ARGS, kv_cache_memory=64 << 20)
        lt.run(one.start(), timeout=300)
        want = lt.run(_greedy(one), timeout=300)
        lt.run(one.shutdown(), timeout=60)

        before = our_segments()
        # 15 layers x 24 KiB a block (float32, 3 KV heads of 64): 20 blocks a stage, fewer
        # than the 8 prompts need together, so requests are preempted and recomputed
        engine = AsyncEngine(**ARGS, kv_cache_memory=20 * 15 * 24576, pipeline_parallel_size=2)
        lt.run(engine.start(), timeout=300)
        ex = engine.executor
        assert len(ex.procs) == 2 and ex.answering == 1  # type: ignore[union-attr]
        got = lt.run(_greedy(engine), timeout=300)
        assert got == want
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.prefix_cache_stats.preempted_hits > 0  # recomputed from the cached prefix

        # both stages computed at once: some forward pass of stage 0 overlaps one of stage 1
        first, last = lt.run(ex.collective_rpc("stage_trace"), timeout=30)  # type: ignore[union-attr]
        assert first and last
        assert overlap_s(first, last) > 0, "the two stages never computed at the same time"

        # a SIGKILLed last stage: the whole set is replaced and every stream still ends right
        started = asyncio.Event()

        async def kill_when_started() -> None:
            await asyncio.wait_for(started.wait(), 120)
            ex.procs[1].kill()  # type: ignore[union-attr]

        async def through_fault() -> list[list[int]]:
            tokens, _ = await asyncio.gather(_greedy(engine, started), kill_when_started())
            return tokens

        assert lt.run(through_fault(), timeout=300) == want
        assert engine.executor is not ex and ex.procs[1].poll() is not None  # type: ignore[union-attr]
        replaced = engine.executor
        lt.run(engine.shutdown(), timeout=60)
        assert all(p.poll() is not None for p in replaced.procs)  # type: ignore[union-attr]
        assert our_segments() == before, "shared memory left behind"
    finally:
        lt.close()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, real_source):
    """Random Qwen3 (4 layers, 4 heads, 2 KV heads, QK-norm) and Qwen3-MoE (3 layers, the
    middle one dense) folders with SmolLM2's tokenizer: {kind: (folder, transformers model)}."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen3_pp")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=real_source.config.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    with torch.no_grad():  # larger weights than the init: logits far apart, no argmax ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model = model.float().eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_source.path / name, path / name)
    moe_path = tmp_path_factory.mktemp("tiny_qwen3_moe_pp")
    moe = moe_model("qwen3_moe", moe_path, tokenizer_from=real_source.path, vocab_size=real_source.config.vocab_size)
    return {"qwen3": (str(path), model), "qwen3_moe": (str(moe_path), moe)}


@pytest.mark.slow
@pytest.mark.parametrize("kind, tp, pp", [("qwen3", 1, 2), ("qwen3", 2, 2), ("qwen3_moe", 1, 2)])
def test_tiny_models_in_stages_give_transformers_tokens(tiny_models, kind, tp, pp):
    path, hf = tiny_models[kind]
    llm = LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{**ARGS, "max_num_batched_tokens": 16})
    try:
        tok = llm.tokenizer
        outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        for prompt, out in zip(PROMPTS[:4], outs):
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            assert out.prompt_token_ids == ids
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
            assert list(out.outputs[0].token_ids) == ref[0, len(ids) :].tolist()
    finally:
        llm.close()
