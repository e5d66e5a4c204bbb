"""The offline LLM: generate / chat in input order, on the real model through worker processes."""

from __future__ import annotations

import pytest
from engine_harness import ENGINE_ARGS

from aiolm import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    with LLM(**ENGINE_ARGS) as model:
        yield model
    assert all(p.poll() is not None for p in model.engine.executor.procs)
    assert not model._runner.thread.is_alive()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_generate_returns_outputs_in_input_order(llm, capsys):
    # Longer requests first: they finish last, so completion order differs from input order.
    lens = [9, 2, 6, 1, 4]
    prompts = ["The sky is", "One plus one is", {"prompt_token_ids": [504, 2988, 314]}, "Hi", "Dogs are"]
    outs = llm.generate(prompts, [greedy(n) for n in lens])
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    assert [o.prompt for o in outs[:2]] == prompts[:2]
    assert outs[2].prompt_token_ids == [504, 2988, 314]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert len({o.request_id for o in outs}) == len(outs)
    # The progress bar went to stderr.
    assert "Generating" in capsys.readouterr().err
    # One SamplingParams for all prompts, a single prompt, no bar: the same greedy text.
    again = llm.generate(["The sky is", "Hi"], greedy(9), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert again[1].outputs[0].token_ids[:1] == outs[3].outputs[0].token_ids
    assert "Generating" not in capsys.readouterr().err
    single = llm.generate("The sky is", greedy(9), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].text == outs[0].outputs[0].text
    with pytest.raises(ValueError):
        llm.generate(["a", "b"], [greedy(1)])


def test_chat_applies_the_template(llm, tokenizer):
    conv = [
        {"role": "system", "content": "You are concise."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    (one,) = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert one.prompt.rstrip().endswith("<|im_start|>assistant")
    assert one.prompt == tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert "Paris" in one.outputs[0].text
    convs = [conv, [{"role": "user", "content": "Say hello."}]]
    two = llm.chat(convs, [SamplingParams(temperature=0.0, max_tokens=8), greedy(3)], use_tqdm=False)
    assert two[0].outputs[0].text == one.outputs[0].text
    assert "Say hello." in two[1].prompt and len(two[1].outputs[0].token_ids) == 3


def test_the_engine_loop_is_uvloop(llm):
    """One uvloop loop is the design: the offline LLM's loop thread runs one too, as the
    server and the CLI do (uvloop is a dependency, so this is never the fallback)."""
    import uvloop

    assert isinstance(llm._runner.loop, uvloop.Loop)
