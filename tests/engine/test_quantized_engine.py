"""Quantized checkpoints served by the whole engine: real worker processes load a GPTQ
(desc_act), an AWQ and an fp8 folder written by the tests' quantizer, and greedy tokens for
prompts batched together equal transformers' on the float32 model of the checkpoint's
values, on one rank (4-bit layers keep their codes for decode steps) and on two (each rank
loads its slices of the dequantized weights)."""

from __future__ import annotations

import pytest
import torch

from aiolm import LLM, SamplingParams
from lora_models import tiny_base
from paged import hf_greedy
from quantized_checkpoints import write_quantized

NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, max_num_seqs=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory, real_source):
    return tiny_base(
        "llama",
        tmp_path_factory.mktemp("quant_engine") / "base",
        real_source.path,
        hidden_size=128,
        intermediate_size=256,
    )


@pytest.mark.parametrize(
    ("fmt", "options", "tp"),
    [
        ("gptq", dict(group_size=32, act_order=True), 1),
        ("awq", dict(group_size=64, sym=False), 1),
        ("gptq", dict(group_size=32, act_order=True), 2),
        ("fp8", {}, 2),
    ],
    ids=["gptq-desc_act", "awq", "gptq-desc_act-tp2", "fp8-tp2"],
)
def test_engine_gives_the_dequantized_models_tokens(base, tmp_path, fmt, options, tp):
    from transformers import AutoModelForCausalLM

    out, ref = tmp_path / "q", tmp_path / "ref"
    write_quantized(base, out, ref, fmt, **options)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (9, 30, 17)]
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    executor = "local" if tp == 1 else "mp"
    with LLM(model=str(out), executor=executor, tensor_parallel_size=tp, **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        text = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0].text
    assert got == expected
    assert text  # the tokenizer and detokenizer of the folder work as for a dense one
