"""The TcpConnector's wire: one TCP connection per pair of ranks (a decode instance's rank
r to the prefill instance's rank r), blocking sockets on the ranks' transfer threads.

Every message is a frame: a 4-byte little-endian length, then that many bytes. Control
frames are JSON; KV frames are raw bytes followed by their CRC-32.

1. Handshake, once per connection: the consumer sends its layout (``layout`` in the
   worker: model, dtypes, block size, KV heads per rank, tensor-parallel size, rank); the
   producer answers ``{"ok": true}`` or ``{"ok": false, "error": ...}`` naming every
   field that differs, and closes.
   Both say which machine they run on (``machine_id``).
2. Fetch, any number per connection: ``{"transfer": id, "blocks": [...]}``; the answer is
   ``{"ok": true, "layers": L}`` and then, per layer, that layer's K and V of the blocks
   as one contiguous buffer (2, blocks, block_size, kv_heads, head bytes) and its CRC-32;
   or ``{"ok": false, "error": ...}`` (an unknown or expired transfer, blocks not its own).
   Between ranks of one machine the consumer names a shared-memory segment of its own
   (``"shm": name``, room for every layer's buffer, one after another); the producer
   writes the layers there and answers with ``"crcs"``, one per layer, and the consumer
   copies them out and unlinks it, whatever happened (a producer that dies mid-write
   leaves nothing behind).
"""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from typing import Any

_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
MAX_CONTROL_BYTES = 1 << 20


class WireError(RuntimeError):
    """The peer broke the protocol, closed, timed out, or sent a damaged frame."""


def send_frame(sock: socket.socket, payload: bytes | memoryview) -> None:
    sock.sendall(_LEN.pack(len(payload)))
    sock.sendall(payload)


def recv_exact(
    sock: socket.socket, n: int, into: memoryview | None = None, deadline: float | None = None
) -> memoryview:
    """``n`` bytes. ``deadline`` (time.monotonic()) bounds the whole read: the socket's own
    timeout bounds each ``recv`` alone, which a peer sending a byte at a time never trips."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        try:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            k = sock.recv_into(buf[got:], n - got)
        except TimeoutError:
            raise WireError("the peer went silent") from None
        except OSError as e:
            raise WireError(f"the connection broke: {e.strerror or e}") from None
        if k == 0:
            raise WireError("the peer closed the connection")
        got += k
    return buf


def recv_frame_len(sock: socket.socket, deadline: float | None = None) -> int:
    return int(_LEN.unpack(recv_exact(sock, _LEN.size, deadline=deadline))[0])


def send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    send_frame(sock, json.dumps(obj).encode())


def recv_json(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    n = recv_frame_len(sock, deadline)
    if n > MAX_CONTROL_BYTES:
        raise WireError(f"a control frame of {n} bytes")
    try:
        obj = json.loads(bytes(recv_exact(sock, n, deadline=deadline)))
    except ValueError:
        raise WireError("a control frame that is not JSON") from None
    if not isinstance(obj, dict):
        raise WireError("a control frame that is not an object")
    return obj


def send_buffer(sock: socket.socket, data: memoryview, crc: int | None = None) -> None:
    """A KV frame: the bytes, then their CRC-32 (``crc``: another one, for fault tests)."""
    send_frame(sock, data)
    sock.sendall(_CRC.pack(zlib.crc32(data) if crc is None else crc))


def recv_buffer(sock: socket.socket, into: memoryview, deadline: float | None = None) -> None:
    """A KV frame into ``into``, which must be exactly its size; WireError when the
    length or the checksum is wrong."""
    n = recv_frame_len(sock, deadline)
    if n != len(into):
        raise WireError(f"a KV frame of {n} bytes where {len(into)} were asked for")
    recv_exact(sock, n, into, deadline)
    (crc,) = _CRC.unpack(recv_exact(sock, _CRC.size, deadline=deadline))
    if zlib.crc32(into) != crc:
        raise WireError("a KV frame failed its checksum")


def machine_id() -> str:
    """This machine and boot: two processes that agree can share memory."""
    parts = []
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    return "/".join([socket.gethostname(), *parts])


def layout_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """A sentence naming each field two layouts disagree on, or None."""
    diffs = [
        f"{key}: producer {mine.get(key)!r}, consumer {theirs.get(key)!r}"
        for key in sorted(set(mine) | set(theirs))
        if mine.get(key) != theirs.get(key)
    ]
    return "; ".join(diffs) if diffs else None
