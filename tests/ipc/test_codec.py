"""Codec round trips: the fast struct path, the pickle fallback and RPC calls."""

from __future__ import annotations

import numpy as np
import pytest

from aiolm.core.step import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from aiolm.ipc import codec
from aiolm.params import OutputKind, SamplingParams
from aiolm.structured.spec import StructuredOutputs


def make_step() -> SchedulerOutput:
    sp = SamplingParams(temperature=0.0, top_k=5, seed=3, stop=["\n\n"], stop_token_ids=[2],
                        logit_bias={7: -1.5}, logprobs=2, output_kind=OutputKind.DELTA,
                        eos_token_ids=(2, 3))
    new = [NewRequestData("a", [1, 2, 3], [9], sp, [4, 5], 16),
           NewRequestData("b", list(range(100)), [], SamplingParams(), [6], 0)]
    cached = CachedRequestData(req_ids=["c", "d"], new_token_ids=[[11], [12, 13]],
                               new_block_ids=[[], [8]], num_computed_tokens=[40, 41])
    return SchedulerOutput(step=7, scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens={"a": 3, "b": 100, "c": 1, "d": 2},
                           total_num_scheduled_tokens=106, finished_req_ids={"x", "y"},
                           grammars={"e": StructuredOutputs("json", '{"type": "object"}', strict=False)})


def test_scheduler_output_round_trip_fast_path():
    so = make_step()
    buf = codec.encode_scheduler_output(so)
    assert buf[:1] == b"S"  # the marshal struct path, not pickle
    back = codec.decode_scheduler_output(memoryview(buf))
    assert back == so
    sp = back.scheduled_new_reqs[0].sampling_params
    assert type(sp) is SamplingParams and sp.output_kind is OutputKind.DELTA
    assert sp.greedy and sp.stop_ids() == {2, 3} and sp.eos_token_ids == (2, 3)
    assert isinstance(back.scheduled_cached_reqs, CachedRequestData) and len(back.scheduled_cached_reqs) == 2
    assert type(back.grammars["e"]) is StructuredOutputs and back.grammars["e"].key() == so.grammars["e"].key()


def test_model_runner_and_core_outputs_round_trip():
    lp = LogprobsLists(token_ids=[[5, 1, 2]], logprobs=[[-0.1, -2.0, -3.5]], ranks=[1])
    mro = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], []], logprobs={"a": lp},
                            grammars_ready=["c"], grammar_errors={"d": "invalid regex"})
    buf = codec.encode_model_runner_output(mro)
    assert buf[:1] == b"S"
    back = codec.decode_model_runner_output(buf)
    assert back == mro and isinstance(back.logprobs["a"], LogprobsLists)
    for out in (EngineCoreOutput("a", [1, 2], "stop", "\n", lp, 3),
                EngineCoreOutput("b", [], error="boom")):
        assert codec.decode(codec.encode(out)) == out


def test_numpy_values_from_the_worker_fall_back_to_pickle():
    """marshal would turn numpy scalars into bytes; worker-side types are checked."""
    mro = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[np.int64(5)], [6]])
    buf = codec.encode(mro)
    assert buf[:1] == b"P"
    assert codec.decode(buf) == mro
    lp = LogprobsLists(token_ids=[[5]], logprobs=[[np.float64(-0.5)]], ranks=[1])
    mro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs={"a": lp})
    assert codec.encode(mro)[:1] == b"P" and codec.decode(codec.encode(mro)) == mro
    clean = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]])
    assert codec.encode(clean)[:1] == b"S"


def test_unmarshallable_scheduler_field_falls_back_to_pickle():
    so = make_step()
    so.scheduled_cached_reqs.num_computed_tokens = [Exception("not marshallable"), 41]
    buf = codec.encode(so)
    assert buf[:1] == b"P"
    assert codec.decode(buf).scheduled_cached_reqs.num_computed_tokens[1] == 41


def test_rpc_by_name_and_by_closure():
    call = codec.decode_rpc(codec.encode_rpc("load_model", (1, "x"), {"dtype": "float32"}))
    assert (call.method, call.args, call.kwargs) == ("load_model", (1, "x"), {"dtype": "float32"})
    base = 10
    call = codec.decode_rpc(codec.encode_rpc(lambda worker, k: worker * k + base, (3,)))
    assert call.method(2, *call.args) == 16


def test_decode_rejects_wrong_kind():
    with pytest.raises(TypeError):
        codec.decode_scheduler_output(codec.encode(ModelRunnerOutput([], [])))
    with pytest.raises(ValueError):
        codec.decode(b"Zjunk")
    assert codec.decode(codec.encode({"any": [1, 2]})) == {"any": [1, 2]}
