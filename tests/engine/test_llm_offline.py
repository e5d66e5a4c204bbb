"""The offline LLM: generate / chat in input order, on the real model through worker processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from engine_harness import ENGINE_ARGS

from aiolm import LLM, ParamError, SamplingParams

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


def test_chat_takes_the_servers_message_shapes(llm, tokenizer):
    """README: LLM.chat takes the same messages as the server. Text parts failed in the template
    ("can only concatenate str"), and a call's arguments, JSON text in OpenAI's shape, reached
    the template as a string it then encoded again."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "Paris?"}]}]
    (one,) = llm.chat(parts, greedy(1), use_tqdm=False)
    plain = [{"role": "user", "content": "What is\nParis?"}]
    assert one.prompt == tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    shown = "{{ messages[1].tool_calls[0].function.arguments.city }}"
    rendered = llm.engine.render_chat([*plain, {"role": "assistant", "tool_calls": [call]}], chat_template=shown)
    assert rendered == "Paris"  # an object, as the server gives it


def test_the_engine_loop_is_uvloop(llm):
    """One uvloop loop is the design: the offline LLM's loop thread runs one too, as the
    server and the CLI do (uvloop is a dependency, so this is never the fallback)."""
    import uvloop

    assert isinstance(llm._runner.loop, uvloop.Loop)


def _running(llm) -> int:
    return len(llm.engine.output.requests)


def _wait_idle(llm, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while _running(llm) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _running(llm)


def test_a_refused_prompt_or_an_interrupt_leaves_nothing_of_the_batch_running(llm):
    """A batch with one bad prompt is refused whole: the prompts added before it were left
    running with nobody to read them. Ctrl+C (a notebook's interrupt) left every request of
    the call running to its max_tokens."""
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    with pytest.raises(ParamError):
        llm.generate(["hello there", {"prompt_token_ids": [10**9]}], long, use_tqdm=False)
    assert _wait_idle(llm) == 0
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Count"] * 4, long, use_tqdm=False)
    finally:
        timer.cancel()
    assert _wait_idle(llm) == 0
    assert llm.generate("Hi", greedy(2), use_tqdm=False)[0].finished  # and it serves on


def test_wrong_types_are_a_clear_error(llm):
    for bad in (None, 5, b"abc"):
        with pytest.raises(TypeError, match="prompts must be"):
            llm.generate(bad, use_tqdm=False)
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        llm.generate("hi", {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(TypeError, match="conversations must be"):
        llm.chat("Hi", use_tqdm=False)  # was a prompt per character


def test_a_chat_template_in_place_of_the_models(tmp_path, tokenizer):
    """vLLM's --chat-template: a file or the template's text wins over the model's own; a
    folder whose template is only in a processor's chat_template.json has it read."""
    from aiolm.checkpoint.source import _chat_template
    from aiolm.errors import ModelLoadError

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    (tmp_path / "t.jinja").write_text(template)
    conv = [{"role": "user", "content": "Hi"}]
    for given in (template, str(tmp_path / "t.jinja")):
        with LLM(**{**ENGINE_ARGS, "executor": "local", "chat_template": given}) as other:
            (out,) = other.chat(conv, greedy(1), use_tqdm=False)
        assert out.prompt == "[user] Hi\n[assistant]"
    with pytest.raises(ModelLoadError, match="--chat-template"):
        LLM(**{**ENGINE_ARGS, "chat_template": str(tmp_path / "missing.jinja")})
    from aiolm.checkpoint.source import read_chat_template

    long = "{% for m in messages %}" + "{{ m['content'] }} and more" * 40 + "{% endfor %}"  # no '/' in 1,000 chars
    assert read_chat_template(long) == long  # (taken for a path, it was an OSError: file name too long)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert _chat_template(tmp_path) == template


def test_generate_takes_vllm_s_priority():
    """With one seat, lower priorities run first whatever their place in the list (vLLM's
    LLM.generate(priority=...)); without the priority policy it is refused, not ignored."""
    with LLM(**{**ENGINE_ARGS, "executor": "local", "max_num_seqs": 1, "scheduling_policy": "priority"}) as llm:
        outs = llm.generate(["a", "b", "c"], greedy(4), use_tqdm=False, priority=[5, 3, 0])
    ttft = [o.metrics["ttft"] for o in outs]
    assert ttft[2] < ttft[1], ttft  # "a" may take the free seat before the others arrive; then c, b
    with LLM(**{**ENGINE_ARGS, "executor": "local"}) as fcfs, pytest.raises(ValueError, match="scheduling_policy"):
        fcfs.generate(["a"], greedy(1), use_tqdm=False, priority=2)
