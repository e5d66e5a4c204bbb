"""Bytes for what crosses the rings: step messages, RPC calls and anything else.

Why not plain pickle for the hot path: unpickling a decode-step SchedulerOutput
(64 requests) costs ~45 us here, most of it per-object reduce calls. Our messages
are dataclasses of builtins, so each is flattened into a tuple of its field values
(nested dataclasses recursively, following the type hints once per class) and the
tuple goes through ``marshal``, which handles lists/dicts/sets/str/int in C, about
twice as fast both ways. Decoding rebuilds instances without re-running
``__init__``/validation (the sender built valid objects). Anything marshal cannot
carry falls back to pickle protocol 5, and RPC payloads that hold callables use
cloudpickle. The first byte of every buffer names its format.

Both ends run the same Python and aiolm version (workers are our own children),
which marshal requires.

One trap: marshal writes any object that exposes the buffer protocol (numpy
scalars such as ``np.int64``/``np.float64``) as *bytes*, silently. Types built
near tensors (ModelRunnerOutput, logprobs, EngineCoreOutput) are therefore
registered with ``check_leaves=True``: their list/scalar fields are type-checked
at C speed before marshal and anything unexpected goes through pickle instead.
Scheduler-side types come from pure-Python code and are trusted to hold plain
ints and strings (checking them would double the encode cost).
"""

from __future__ import annotations

import dataclasses
import enum
import marshal
import pickle
import types
import typing
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, Callable

import cloudpickle

from aiolm.core.step import (
    CachedRequestData,
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from aiolm.params import SamplingParams

__all__ = [
    "RpcCall", "decode", "decode_model_runner_output", "decode_rpc", "decode_scheduler_output",
    "encode", "encode_model_runner_output", "encode_rpc", "encode_scheduler_output",
    "register_struct",
]

SHUTDOWN = "shutdown"  # the message that tells a worker to exit

_TAG_STRUCT = 0x53  # b"S": marshal of a flattened registered dataclass
_TAG_PICKLE = 0x50  # b"P": pickle protocol 5 (cloudpickle output uses this tag too)


@dataclass
class RpcCall:
    """A method name (or a callable, shipped with cloudpickle) to run on each worker."""

    method: str | Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------- struct codec

# Per-field conversion kinds, derived once from type hints.
_PLAIN, _DC, _OPT_DC, _LIST_DC, _DICT_DC, _ENUM = range(6)


class _Spec:
    """How to flatten and rebuild one dataclass type."""

    __slots__ = ("cls", "names", "kinds", "plain", "checks")

    def __init__(self, cls: type, names: tuple[str, ...], kinds: tuple[tuple[int, Any], ...],
                 checks: tuple[Callable[[Any], bool] | None, ...] | None) -> None:
        self.cls = cls
        self.names = names
        self.kinds = kinds
        self.checks = checks
        self.plain = checks is None and all(k == _PLAIN for k, _ in kinds)


_SCALAR_OK = {int: frozenset({int, bool}), float: frozenset({float, int}), str: frozenset({str}),
              bool: frozenset({bool})}
_NONE = type(None)


def _allowed(hint: Any) -> frozenset | None:
    """Exact types a scalar hint accepts (``int | str | None`` -> their union)."""
    if hint in _SCALAR_OK:
        return _SCALAR_OK[hint]
    if hint is _NONE or hint is None:
        return frozenset({_NONE})
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_allowed(a) for a in typing.get_args(hint)]
        if all(p is not None for p in parts):
            return frozenset().union(*parts)
    return None


def _numeric_sum_check(ok: frozenset) -> Callable[[Any], bool] | None:
    """For int/float leaves ``sum`` is the fastest exactness test: one numpy scalar
    (or array, or tensor) anywhere makes the total a non-builtin type."""
    if ok <= _SCALAR_OK[int]:
        return lambda items: type(sum(items)) is int
    if ok == _SCALAR_OK[float]:
        return lambda items: type(sum(items, 0.0)) is float
    return None


def _leaf_check(hint: Any) -> Callable[[Any], bool] | None:
    """A C-speed test that a plain field holds exactly the builtin types its hint says."""
    ok = _allowed(hint)
    if ok is not None:
        return lambda v: type(v) in ok
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and _NONE in args:
        rest = [a for a in args if a is not _NONE]
        inner = _leaf_check(rest[0]) if len(rest) == 1 else None
        if inner is not None:
            return lambda v: v is None or inner(v)
    if origin in (list, set, frozenset) and args:
        seq = frozenset({origin})
        ok = _allowed(args[0])
        if ok is not None:
            total = _numeric_sum_check(ok)
            if total is not None:
                return lambda v: type(v) in seq and total(v)
            return lambda v: type(v) in seq and set(map(type, v)) <= ok
        if typing.get_origin(args[0]) is list and typing.get_args(args[0]):
            ok = _allowed(typing.get_args(args[0])[0])
            total = None if ok is None else _numeric_sum_check(ok)
            if total is not None:
                return lambda v: type(v) in seq and total(chain.from_iterable(v))
            if ok is not None:
                return lambda v: type(v) in seq and set(map(type, chain.from_iterable(v))) <= ok
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        ok = _allowed(args[0])
        if ok is not None:
            return lambda v: type(v) is tuple and set(map(type, v)) <= ok
    if origin is dict and len(args) == 2:
        ok_k, ok_v = _allowed(args[0]), _allowed(args[1])
        if ok_k is not None and ok_v is not None:
            return lambda v: (type(v) is dict and set(map(type, v)) <= ok_k
                              and set(map(type, v.values())) <= ok_v)
    return None


_SPECS: dict[type, _Spec] = {}
_IDS: dict[type, int] = {}
_BY_ID: list[_Spec] = []


def _kind_of(hint: Any) -> tuple[int, Any]:
    if isinstance(hint, type):
        if dataclasses.is_dataclass(hint):
            return _DC, hint
        if issubclass(hint, enum.Enum):
            return _ENUM, hint
        return _PLAIN, None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            kind, sub = _kind_of(rest[0])
            if kind == _DC:
                return _OPT_DC, sub
            if kind == _ENUM:
                raise TypeError("optional enums are not supported by the struct codec")
            return kind, sub
        if any(_kind_of(a)[0] != _PLAIN for a in rest):
            raise TypeError(f"unions of dataclasses are not supported: {hint}")
        return _PLAIN, None
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return _LIST_DC, args[0]
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return _DICT_DC, args[1]
    return _PLAIN, None


def register_struct(cls: type, check_leaves: bool = False) -> None:
    """Let the fast codec carry ``cls`` (a dataclass of builtins/enums/dataclasses).

    ``check_leaves``: verify plain fields hold exactly the builtin types their
    hints name before using marshal (for values that may come from numpy/torch);
    a field whose hint cannot be checked that way sends the object through pickle.
    """
    if cls in _SPECS:
        return
    hints = typing.get_type_hints(cls)
    names, kinds, checks = [], [], []
    for f in dataclasses.fields(cls):
        kind = _kind_of(hints[f.name])
        names.append(f.name)
        kinds.append(kind)
        if check_leaves and kind[0] == _PLAIN:
            check = _leaf_check(hints[f.name])
            checks.append(check if check is not None else (lambda v: False))
        else:
            checks.append(None)
    _SPECS[cls] = _Spec(cls, tuple(names), tuple(kinds), tuple(checks) if check_leaves else None)
    _IDS[cls] = len(_BY_ID)
    _BY_ID.append(_SPECS[cls])
    for kind, sub in kinds:
        if kind in (_DC, _OPT_DC, _LIST_DC, _DICT_DC):
            register_struct(sub, check_leaves)


def _flatten(obj: Any) -> tuple:
    spec = _SPECS[type(obj)]
    d = obj.__dict__
    if spec.plain:
        return tuple([d[n] for n in spec.names])
    out = []
    checks = spec.checks or repeat(None)
    for n, (kind, _sub), check in zip(spec.names, spec.kinds, checks):
        v = d[n]
        if kind == _PLAIN:
            if check is not None and not check(v):
                raise TypeError(f"{spec.cls.__name__}.{n} holds a value the fast codec cannot carry")
            out.append(v)
        elif kind == _LIST_DC:
            out.append([_flatten(x) for x in v])
        elif kind == _DC:
            out.append(_flatten(v))
        elif kind == _OPT_DC:
            out.append(None if v is None else _flatten(v))
        elif kind == _DICT_DC:
            out.append({k: _flatten(x) for k, x in v.items()})
        else:  # _ENUM
            out.append(v.value)
    return tuple(out)


def _build(spec: _Spec, values: tuple) -> Any:
    obj = object.__new__(spec.cls)
    if spec.plain:
        obj.__dict__.update(zip(spec.names, values))
        return obj
    d = obj.__dict__
    for n, (kind, sub), v in zip(spec.names, spec.kinds, values):
        if kind == _PLAIN:
            d[n] = v
        elif kind == _LIST_DC:
            s = _SPECS[sub]
            d[n] = [_build(s, x) for x in v]
        elif kind == _DC:
            d[n] = _build(_SPECS[sub], v)
        elif kind == _OPT_DC:
            d[n] = None if v is None else _build(_SPECS[sub], v)
        elif kind == _DICT_DC:
            s = _SPECS[sub]
            d[n] = {k: _build(s, x) for k, x in v.items()}
        else:  # _ENUM
            d[n] = sub(v)
    return obj


for _cls in (SchedulerOutput, NewRequestData, CachedRequestData, SamplingParams):
    register_struct(_cls)
for _cls in (ModelRunnerOutput, LogprobsLists, EngineCoreOutput):
    register_struct(_cls, check_leaves=True)


# --------------------------------------------------------------- public API

def encode(obj: Any) -> bytes:
    """Serialize any message: the struct codec for registered dataclasses, else pickle 5."""
    type_id = _IDS.get(type(obj))
    if type_id is not None:
        try:
            return bytes((_TAG_STRUCT, type_id)) + marshal.dumps(_flatten(obj))
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # a field holds something marshal cannot carry (or a subclass value)
    return bytes((_TAG_PICKLE,)) + pickle.dumps(obj, protocol=5)


def decode(buf: bytes | bytearray | memoryview) -> Any:
    """Inverse of ``encode`` / ``encode_rpc``."""
    mv = memoryview(buf)
    tag = mv[0]
    if tag == _TAG_STRUCT:
        return _build(_BY_ID[mv[1]], marshal.loads(mv[2:]))
    if tag == _TAG_PICKLE:
        return pickle.loads(mv[1:])
    raise ValueError(f"unknown message format byte {tag:#x}")


def encode_scheduler_output(so: SchedulerOutput) -> bytes:
    """The per-step engine -> workers message."""
    return encode(so)


def decode_scheduler_output(buf: bytes | bytearray | memoryview) -> SchedulerOutput:
    obj = decode(buf)
    if not isinstance(obj, SchedulerOutput):
        raise TypeError(f"expected SchedulerOutput, got {type(obj).__name__}")
    return obj


def encode_model_runner_output(out: ModelRunnerOutput) -> bytes:
    """The per-step rank 0 -> engine reply."""
    return encode(out)


def decode_model_runner_output(buf: bytes | bytearray | memoryview) -> ModelRunnerOutput:
    obj = decode(buf)
    if not isinstance(obj, ModelRunnerOutput):
        raise TypeError(f"expected ModelRunnerOutput, got {type(obj).__name__}")
    return obj


def encode_rpc(method: str | Callable[..., Any], args: tuple = (),
               kwargs: dict[str, Any] | None = None) -> bytes:
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
