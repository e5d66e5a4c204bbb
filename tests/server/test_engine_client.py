"""Both engines the server can serve implement the EngineClient protocol it is typed against.

The static check is mypy's (``_served`` takes an EngineClient and is called with both);
the runtime one says each member the protocol lists is really there, so a method the
server calls cannot be missing from one engine (DataParallelEngine has no __getattr__
to forward what it lacks).
"""

from __future__ import annotations

import inspect

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.engine.client import EngineClient
from aiolm.engine.data_parallel import DataParallelEngine, create_engine

# Data members an AsyncEngine sets when it starts (read from the model) or in __init__.
_SET_AT_START = {"model_name", "max_model_len"}


def _members() -> set[str]:
    names = {k for k in vars(EngineClient) if not k.startswith("_")}
    return names | set(EngineClient.__annotations__)


def _served(engine: EngineClient) -> str:
    return type(engine).__name__


def test_both_engines_are_engine_clients():
    single = AsyncEngine(EngineArgs())
    dp = DataParallelEngine(EngineArgs(data_parallel_size=2))
    assert (_served(single), _served(dp)) == ("AsyncEngine", "DataParallelEngine")
    assert isinstance(create_engine(EngineArgs(data_parallel_size=2)), DataParallelEngine)
    assert not hasattr(DataParallelEngine, "__getattr__")
    members = _members()
    assert {
        "add_request",
        "stream",
        "abort",
        "generate",
        "is_healthy",
        "tokenize",
        "render_chat_async",
        "prompt_too_long",
        "vocab_size",
        "model_name",
        "max_model_len",
        "metrics",
    } <= members
    for name in sorted(members):
        for engine in (single, dp):
            cls = type(engine)
            present = hasattr(cls, name) or name in vars(engine) or (cls is AsyncEngine and name in _SET_AT_START)
            assert present, f"{cls.__name__} lacks {name}"
            proto = inspect.getattr_static(EngineClient, name, None)
            if inspect.isfunction(proto):  # a method: the same kind (coroutine or not) on both sides
                impl = inspect.getattr_static(cls, name)
                assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(proto), (cls, name)
