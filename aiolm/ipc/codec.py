"""Bytes for what crosses the rings: step messages, RPC calls and anything else.

The two messages of every step, SchedulerOutput (engine -> workers) and
ModelRunnerOutput (rank 0 -> engine), are ``msgspec`` Structs (aiolm/core/step.py)
and travel as MessagePack through one encoder and one decoder per process. The
decoder's type is the tagged union of the two, so it checks every field against
its annotation in C and builds the objects without calling ``__init__``.

SamplingParams is a validating dataclass (aiolm/params.py): msgspec would send it
as a map of field names and re-run its validation on decoding. It travels instead
as an array of its field values (``_SamplingParamsWire``, generated from its fields,
so a new field needs no change here) and is rebuilt without validation: the engine
validated it before the request was queued.

Everything else (RPC calls, their results, a worker's start-up and error reports,
the shutdown word) is rare and holds arbitrary Python values: it goes through
pickle protocol 5, and an RPC whose method is a lambda or closure through
cloudpickle. A pickled buffer starts with ``P``; a msgspec buffer never does
(a tagged Struct is a MessagePack array, whose first byte is 0x90-0x9f, 0xdc or
0xdd), so no framing byte is copied in front of the hot messages.

Both ends run the same Python and aiolm (workers are our own children), which
the array-shaped encoding (fields by position) requires.
"""

from __future__ import annotations

import dataclasses
import pickle
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import msgspec

from aiolm.core.step import ModelRunnerOutput, NewRequestData, SchedulerOutput
from aiolm.params import SamplingParams

__all__ = [
    "SHUTDOWN",
    "RpcCall",
    "decode",
    "decode_model_runner_output",
    "decode_rpc",
    "decode_scheduler_output",
    "encode",
    "encode_model_runner_output",
    "encode_rpc",
    "encode_scheduler_output",
]

SHUTDOWN = "shutdown"  # the message that tells a worker to exit

_TAG_PICKLE = 0x50  # b"P"


@dataclass
class RpcCall:
    """A method name (or a callable, shipped with cloudpickle) to run on each worker."""

    method: str | Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------- SamplingParams on the wire

_PARAM_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
_PARAM_HINTS = typing.get_type_hints(SamplingParams)
_SamplingParamsWire = msgspec.defstruct(
    "SamplingParamsWire", [(name, _PARAM_HINTS[name]) for name in _PARAM_NAMES], array_like=True, gc=False
)


class _NewRequestWire(NewRequestData):
    """NewRequestData as decoded: the same fields, its SamplingParams as an array."""

    sampling_params: _SamplingParamsWire  # type: ignore[valid-type]


class _SchedulerOutputWire(SchedulerOutput, tag="SchedulerOutput"):
    """SchedulerOutput as decoded (same tag, same fields), new requests as ``_NewRequestWire``."""

    scheduled_new_reqs: list[_NewRequestWire]  # type: ignore[assignment]


def _params_to_wire(sp: SamplingParams) -> Any:
    d = sp.__dict__
    return _SamplingParamsWire(*[d[n] for n in _PARAM_NAMES])


def _params_from_wire(wire: Any) -> SamplingParams:
    sp = object.__new__(SamplingParams)  # validated by the engine before it was sent
    sp.__dict__.update(zip(_PARAM_NAMES, msgspec.structs.astuple(wire)))
    return sp


def _to_wire(so: SchedulerOutput) -> SchedulerOutput:
    if not so.scheduled_new_reqs:
        return so
    new = [_NewRequestWire(*_with_params(r, _params_to_wire(r.sampling_params))) for r in so.scheduled_new_reqs]
    return msgspec.structs.replace(so, scheduled_new_reqs=new)


def _from_wire(wire: SchedulerOutput) -> SchedulerOutput:
    new = [NewRequestData(*_with_params(r, _params_from_wire(r.sampling_params))) for r in wire.scheduled_new_reqs]
    return SchedulerOutput(wire.step, new, *msgspec.structs.astuple(wire)[2:])


_PARAMS_AT = NewRequestData.__struct_fields__.index("sampling_params")


def _with_params(r: NewRequestData, params: Any) -> list[Any]:
    """``r``'s field values in order, its sampling params replaced by ``params``."""
    values = list(msgspec.structs.astuple(r))
    values[_PARAMS_AT] = params
    return values


# --------------------------------------------------------------- encoder and decoder


def _enc_hook(obj: Any) -> Any:
    """numpy scalars and arrays (and tensors) that reach a message become plain lists and
    numbers; the decoder then checks them against the field's type like anything else."""
    tolist = getattr(obj, "tolist", None)
    if tolist is None:
        raise NotImplementedError(f"{type(obj).__name__} cannot cross the rings")
    return tolist()


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(_SchedulerOutputWire | ModelRunnerOutput)


def encode(obj: Any) -> bytes:
    """Serialize any message: MessagePack for the step messages, else pickle 5."""
    if type(obj) is SchedulerOutput:
        return _ENCODER.encode(_to_wire(obj))
    if type(obj) is ModelRunnerOutput:
        return _ENCODER.encode(obj)
    return bytes((_TAG_PICKLE,)) + pickle.dumps(obj, protocol=5)


def decode(buf: bytes | bytearray | memoryview) -> Any:
    """Inverse of ``encode`` / ``encode_rpc``."""
    if not buf:
        raise ValueError("empty message")
    if buf[0] == _TAG_PICKLE:
        return pickle.loads(memoryview(buf)[1:])
    try:
        msg = _DECODER.decode(buf)
    except msgspec.DecodeError as e:
        raise ValueError(f"undecodable message: {e}") from e
    return _from_wire(msg) if type(msg) is _SchedulerOutputWire else msg


def encode_scheduler_output(so: SchedulerOutput) -> bytes:
    """The per-step engine -> workers message."""
    return encode(so)


def decode_scheduler_output(buf: bytes | bytearray | memoryview) -> SchedulerOutput:
    obj = decode(buf)
    if not isinstance(obj, SchedulerOutput):
        raise TypeError(f"expected SchedulerOutput, got {type(obj).__name__}")
    return obj


def encode_model_runner_output(runner_output: ModelRunnerOutput) -> bytes:
    """The per-step rank 0 -> engine reply."""
    return encode(runner_output)


def decode_model_runner_output(buf: bytes | bytearray | memoryview) -> ModelRunnerOutput:
    obj = decode(buf)
    if not isinstance(obj, ModelRunnerOutput):
        raise TypeError(f"expected ModelRunnerOutput, got {type(obj).__name__}")
    return obj


def encode_rpc(method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None) -> bytes:
    """An ``RpcCall``; plain pickle when it can, cloudpickle for lambdas/closures."""
    call = RpcCall(method, tuple(args), dict(kwargs or {}))
    if isinstance(method, str):
        try:
            return bytes((_TAG_PICKLE,)) + pickle.dumps(call, protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError):
            pass
    return bytes((_TAG_PICKLE,)) + cloudpickle.dumps(call, protocol=5)


def decode_rpc(buf: bytes | bytearray | memoryview) -> RpcCall:
    obj = decode(buf)
    if not isinstance(obj, RpcCall):
        raise TypeError(f"expected RpcCall, got {type(obj).__name__}")
    return obj
