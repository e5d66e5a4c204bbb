"""Codec round trips: the msgspec step messages, the pickle path and RPC calls."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolm.core.step import (
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)
from aiolm.ipc import codec
from aiolm.params import OutputKind, SamplingParams
from aiolm.structured.spec import StructuredOutputs


def make_step() -> SchedulerOutput:
    sp = SamplingParams(
        temperature=0.0,
        top_k=5,
        seed=3,
        stop=["\n\n"],
        stop_token_ids=[2],
        logit_bias={7: -1.5},
        logprobs=2,
        output_kind=OutputKind.DELTA,
        eos_token_ids=(2, 3),
        bad_words_token_ids=[[4, 5]],
        structured_outputs=StructuredOutputs("regex", "a+"),
    )
    new = [
        NewRequestData("a", [1, 2, 3], [9], sp, [4, 5], 16),
        NewRequestData("b", list(range(100)), [], SamplingParams(), [6], 0),
    ]
    cached = CachedRequestData(
        req_ids=["c", "d"], new_token_ids=[[11], [12, 13]], new_block_ids=[[], [8]], num_computed_tokens=[40, 41]
    )
    return SchedulerOutput(
        step=7,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"a": 3, "b": 100, "c": 1, "d": 2},
        total_num_scheduled_tokens=106,
        finished_req_ids={"x", "y"},
        scheduled_spec_decode_tokens={"d": [13]},
        grammars={"e": StructuredOutputs("json", '{"type": "object"}', strict=False)},
    )


def test_scheduler_output_round_trip():
    so = make_step()
    buf = codec.encode_scheduler_output(so)
    assert buf[:1] != b"P"  # msgspec, not the pickle path
    back = codec.decode_scheduler_output(memoryview(buf))
    assert type(back) is SchedulerOutput and back == so
    sp = back.scheduled_new_reqs[0].sampling_params
    assert type(sp) is SamplingParams and sp == so.scheduled_new_reqs[0].sampling_params
    assert sp.output_kind is OutputKind.DELTA and type(sp.structured_outputs) is StructuredOutputs
    assert sp.greedy and sp.stop_ids() == {2, 3} and sp.eos_token_ids == (2, 3)
    assert isinstance(back.scheduled_cached_reqs, CachedRequestData) and len(back.scheduled_cached_reqs) == 2
    assert type(back.grammars["e"]) is StructuredOutputs and back.grammars["e"].key() == so.grammars["e"].key()
    assert back.finished_req_ids == {"x", "y"}


def test_model_runner_output_round_trip():
    lp = LogprobsLists(token_ids=[[5, 1, 2]], logprobs=[[-0.1, -2.0, float("-inf")]], ranks=[1])
    runner_output = ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[5], []],
        logprobs={"a": lp},
        prompt_logprobs={"b": PromptLogprobs(3, lp)},
        worker_times=[0.1, 0.2, 0.3],
        worker_clock=[1.0, 2.0],
        grammars_ready=["c"],
        grammar_errors={"d": "invalid regex"},
    )
    buf = codec.encode_model_runner_output(runner_output)
    assert buf[:1] != b"P"
    back = codec.decode_model_runner_output(buf)
    assert back == runner_output and isinstance(back.logprobs["a"], LogprobsLists)
    assert isinstance(back.prompt_logprobs["b"], PromptLogprobs)


def test_numpy_values_from_the_worker_become_plain_numbers():
    """Values built near tensors may be numpy scalars; they arrive as Python ints and floats."""
    lp = LogprobsLists(token_ids=[[np.int64(5)]], logprobs=[[np.float32(-0.5)]], ranks=[np.int32(1)])
    runner_output = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[np.int64(5)], [6]], logprobs={"a": lp})
    back = codec.decode(codec.encode(runner_output))
    assert back.sampled_token_ids == [[5], [6]] and type(back.sampled_token_ids[0][0]) is int
    assert back.logprobs["a"] == LogprobsLists([[5]], [[-0.5]], [1])
    assert type(back.logprobs["a"].logprobs[0][0]) is float


def test_a_field_of_the_wrong_type_is_an_error_not_a_silent_change():
    so = make_step()
    so.scheduled_cached_reqs.num_computed_tokens = ["forty", 41]
    with pytest.raises(ValueError, match="Expected `int`, got `str`"):
        codec.decode(codec.encode(so))
    so.scheduled_cached_reqs.num_computed_tokens = [object(), 41]
    with pytest.raises(NotImplementedError, match="object"):
        codec.encode(so)


def test_rpc_by_name_and_by_closure():
    call = codec.decode_rpc(codec.encode_rpc("load_model", (1, "x"), {"dtype": "float32"}))
    assert (call.method, call.args, call.kwargs) == ("load_model", (1, "x"), {"dtype": "float32"})
    base = 10
    call = codec.decode_rpc(codec.encode_rpc(lambda worker, k: worker * k + base, (3,)))
    assert call.method(2, *call.args) == 16


def test_decode_rejects_wrong_kind():
    with pytest.raises(TypeError):
        codec.decode_scheduler_output(codec.encode(ModelRunnerOutput([], [])))
    with pytest.raises(TypeError):
        codec.decode_model_runner_output(codec.encode(make_step()))
    with pytest.raises(ValueError):
        codec.decode(b"Zjunk")
    with pytest.raises(ValueError):
        codec.decode(b"")
    assert codec.decode(codec.encode({"any": [1, 2]})) == {"any": [1, 2]}
    assert codec.decode(codec.encode(("error", "boom", "tb"))) == ("error", "boom", "tb")
    assert codec.decode(codec.encode(codec.SHUTDOWN)) == codec.SHUTDOWN


# ------------------------------------------------------------------ properties

ids = st.integers(0, 2**31 - 1)
names = st.text(min_size=1, max_size=12)
floats = st.floats(allow_nan=False)
token_lists = st.lists(ids, max_size=40)

params = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100),
    seed=st.none() | st.integers(-(2**63), 2**62),
    logit_bias=st.none() | st.dictionaries(ids, st.floats(-100, 100), max_size=3),
    allowed_token_ids=st.none() | st.lists(ids, min_size=1, max_size=5),
    bad_words_token_ids=st.none() | st.lists(st.lists(ids, min_size=1, max_size=3), max_size=3),
    max_tokens=st.none() | st.integers(1, 4096),
    stop=st.lists(names, max_size=3),
    stop_token_ids=st.lists(ids, max_size=3),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    output_kind=st.sampled_from(list(OutputKind)),
    structured_outputs=st.none() | st.builds(StructuredOutputs, st.sampled_from(["json", "regex"]), names),
    eos_token_ids=st.lists(ids, max_size=2).map(tuple),
)


@st.composite
def scheduler_outputs(draw: st.DrawFn) -> SchedulerOutput:
    new = draw(
        st.lists(st.builds(NewRequestData, names, token_lists, token_lists, params, token_lists, ids), max_size=4)
    )
    n = draw(st.integers(0, 5))
    cached = CachedRequestData(
        req_ids=draw(st.lists(names, min_size=n, max_size=n)),
        new_token_ids=draw(st.lists(token_lists, min_size=n, max_size=n)),
        new_block_ids=draw(st.lists(token_lists, min_size=n, max_size=n)),
        num_computed_tokens=draw(st.lists(ids, min_size=n, max_size=n)),
    )
    return SchedulerOutput(
        step=draw(ids),
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=draw(st.dictionaries(names, ids, max_size=6)),
        total_num_scheduled_tokens=draw(ids),
        finished_req_ids=draw(st.sets(names, max_size=3)),
        scheduled_spec_decode_tokens=draw(st.dictionaries(names, token_lists, max_size=3)),
        grammars=draw(st.dictionaries(names, st.builds(StructuredOutputs, st.just("json"), names), max_size=2)),
    )


logprobs_lists = st.integers(0, 3).flatmap(
    lambda n: st.builds(
        LogprobsLists,
        st.lists(token_lists, min_size=n, max_size=n),
        st.lists(st.lists(floats, max_size=4), min_size=n, max_size=n),
        st.lists(ids, min_size=n, max_size=n),
    )
)

runner_outputs = st.builds(
    ModelRunnerOutput,
    st.lists(names, max_size=6),
    st.lists(token_lists, max_size=6),
    logprobs=st.dictionaries(names, logprobs_lists, max_size=3),
    prompt_logprobs=st.dictionaries(names, st.builds(PromptLogprobs, ids, logprobs_lists), max_size=2),
    worker_times=st.lists(floats, max_size=3),
    worker_clock=st.lists(floats, max_size=2),
    grammars_ready=st.lists(names, max_size=2),
    grammar_errors=st.dictionaries(names, names, max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(scheduler_outputs())
def test_any_scheduler_output_round_trips(so: SchedulerOutput):
    back = codec.decode_scheduler_output(codec.encode_scheduler_output(so))
    assert back == so
    for sent, got in zip(so.scheduled_new_reqs, back.scheduled_new_reqs):
        assert type(got.sampling_params) is SamplingParams and got.sampling_params == sent.sampling_params


@settings(max_examples=150, deadline=None)
@given(runner_outputs)
def test_any_model_runner_output_round_trips(runner_output: ModelRunnerOutput):
    assert codec.decode_model_runner_output(codec.encode_model_runner_output(runner_output)) == runner_output
