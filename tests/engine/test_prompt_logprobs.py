"""Prompt logprobs through the real engine equal a float32 forward of the prompt in transformers."""

from __future__ import annotations

import pytest
import torch

from aiolm import LLM, SamplingParams
from aiolm.params import ParamError

pytestmark = pytest.mark.slow

# Chunks of 32 tokens: a long prompt is scored over several steps (and none of them is a
# matmul of 16 rows or fewer, where the GGUF model's quantized-block kernel would run).
PROMPT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, Berlin is "
    "the capital of Germany, and Madrid is the capital of Spain. The largest planet is Jupiter, "
    "the smallest is Mercury, and the one we live on is called the Earth, third from the Sun."
)
NUM_TOKENS = 56  # two chunks: 32 and 24 positions


@pytest.fixture(scope="module")
def llm():
    with LLM(
        max_model_len=512, kv_cache_memory=128 << 20, num_threads=1, max_num_batched_tokens=32, max_logprobs=5
    ) as model:
        yield model


def _reference(hf_reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_reference(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_match_a_float32_forward(llm, hf_reference):
    ids = llm.engine.tokenize(PROMPT, True)[:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    top = 3
    asked, plain = llm.generate(
        [{"prompt_token_ids": ids}] * 2,
        [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=top), SamplingParams(temperature=0, max_tokens=2)],
        use_tqdm=False,
    )
    assert plain.prompt_logprobs is None
    plp = asked.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    ref = _reference(hf_reference, ids)
    worst = 0.0
    for i in range(1, len(ids)):
        entry, row = plp[i], ref[i - 1]
        tok = ids[i]
        worst = max(worst, abs(entry[tok].logprob - float(row[tok])))
        assert entry[tok].rank == int((row >= row[tok]).sum()) or abs(entry[tok].logprob - float(row.max())) < 1e-4
        ref_top = row.topk(top).indices.tolist()
        got_top = sorted((t for t in entry if t != tok or entry[t].rank <= top), key=lambda t: entry[t].rank)
        assert set(ref_top) <= set(entry), (i, ref_top, entry)
        assert len(got_top) >= top
    assert worst < 1e-4, worst
    assert asked.outputs[0].token_ids == plain.outputs[0].token_ids  # scoring changes no output


def test_prompt_logprobs_ignore_the_prefix_cache_and_n(llm):
    ids = llm.engine.tokenize(PROMPT, True)[:NUM_TOKENS]
    warm = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert warm[0].outputs[0].token_ids
    first, again = (
        llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=0),
            use_tqdm=False,
        )[0]
        for _ in range(2)
    )
    assert len(first.prompt_logprobs) == len(ids)  # the cached prefix was computed again
    assert [e and {t: v.logprob for t, v in e.items()} for e in first.prompt_logprobs] == [
        e and {t: v.logprob for t, v in e.items()} for e in again.prompt_logprobs
    ]
    assert all(len(e) == 1 for e in first.prompt_logprobs[1:])  # 0 alternatives: the token itself


def test_prompt_logprobs_bounded_by_max_logprobs(llm):
    with pytest.raises(ParamError) as e:
        llm.generate(["hi"], SamplingParams(max_tokens=1, prompt_logprobs=6), use_tqdm=False)
    assert e.value.param == "prompt_logprobs"
