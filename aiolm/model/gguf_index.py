"""Where each tensor of a GGUF file lies, read without parsing the metadata's values.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata field,
and a tokenizer's vocabulary is tens of thousands of strings, so opening the
embedded model with it costs seconds of Python on every worker start. Attaching
the file's blocks (aiolm/quant/gguf_blocks.py) only needs the tensor table, so
this reads the header, steps over the metadata by its lengths, and maps the
tensors' bytes. The format is ggml's GGUF v2/v3 (little-endian).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Byte sizes of GGUF's scalar value types (uint8 ... float64; bool is 7).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32 = 4
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorBlocks:
    """One tensor's raw bytes in the file: ``data`` is ``[rows, bytes per row]`` uint8."""

    name: str
    type_name: str
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self) -> bytes:
        n = self.take("Q")
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.take("Q")  # read before adding: take() moves pos
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[etype] * count
            elif etype == _STRING:  # a vocabulary: tens of thousands, so one tight loop
                pos, length = self.pos, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(self.buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[vtype]
        else:
            raise ValueError(f"GGUF: unknown value type {vtype} at byte {self.pos}")


def read_tensors(path: str | Path) -> dict[str, TensorBlocks]:
    """Every tensor of the GGUF file at ``path``, by its GGUF name, as views of a read-only map."""
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    version = cur.take("I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.take("I")
        if key == b"general.alignment" and vtype == _UINT32:
            alignment = cur.take("I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string().decode()
        dims = [cur.take("Q") for _ in range(cur.take("I"))]
        ttype, offset = cur.take("I"), cur.take("Q")
        infos.append((name, dims, ttype, offset))
    start = (cur.pos + alignment - 1) // alignment * alignment
    raw = np.frombuffer(buf, dtype=np.uint8)
    out: dict[str, TensorBlocks] = {}
    for name, dims, ttype, offset in infos:
        qtype = GGMLQuantizationType(ttype)
        block, nbytes = GGML_QUANT_SIZES[qtype]
        row_bytes = dims[0] // block * nbytes  # dims[0] is the innermost (a row's) length
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        data = raw[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
        out[name] = TensorBlocks(name, qtype.name, data)
    return out
