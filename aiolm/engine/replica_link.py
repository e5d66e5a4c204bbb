"""The connection between a data-parallel front end and one replica process.

One TCP connection per replica (loopback for local replicas, the cluster network for
Ray ones). The replica connects to the front end and first sends its secret, 32 raw
bytes that only the front end and the process it launched know; the front end compares
them before it reads anything else, so nobody else's bytes are ever unpickled. After
that every message is a frame: a 4-byte little-endian length, then a pickled tuple
whose first item names it.

Front end to replica:
    ("engine", EngineArgs, engine_index)      once, first
    ("add", call, rid, prompt, params, priority, timeout, lora)
    ("encode", call, rid, prompt, pooling_params, priority, truncate, timeout)
    ("abort", rid)
    ("add_lora", call, LoRARequest) / ("remove_lora", call, name)
    ("metrics", call)                          its metric families and status, fresh
    ("shutdown",)
Replica to front end:
    ("ready", status) / ("failed", error)      once, when its engine started or did not
    ("reply", call, error | None, value)
    ("outputs", [(rid, output | None, error | None), ...])   None, None: the stream ended
    ("status", status)                         health and load, every STATUS_PERIOD_S
    ("dead", reason)                           its engine died; the process exits next
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

from aiolm.engine.errors import RequestError

SECRET_BYTES = 32
SECRET_ENV = "AIOLM_REPLICA_SECRET"
STATUS_PERIOD_S = 0.25
_LEN = struct.Struct("<I")


async def read_message(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    """The next message; IncompleteReadError once the peer has closed."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return pickle.loads(await reader.readexactly(n))  # noqa: S301 -- the authenticated peer only


def write_message(writer: asyncio.StreamWriter, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LEN.pack(len(data)) + data)


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling as itself (the engine's own errors do), else a
    RequestError that names it: what crosses the link is always an exception."""
    try:
        back = pickle.loads(pickle.dumps(error))  # noqa: S301 -- our own bytes
    except Exception:
        back = None
    if isinstance(back, BaseException) and type(back) is type(error):
        return error
    return RequestError(f"{type(error).__name__}: {error}")
