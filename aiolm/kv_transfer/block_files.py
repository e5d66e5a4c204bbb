"""The disk tier's files: one per KV block and rank, named by the block's hash.

Layout: ``<disk_path>/<fingerprint>/rank<R>/<hash hex>.kv``. The fingerprint names
everything that decides what a block's bytes mean (the model's files, dtypes, block
size, tensor-parallel size): engines that differ in any of it never read each other's
files. Block hashes are stable across restarts because the engine seeds its prefix
hashes with the fingerprint when the disk tier is on.

A file is a fixed header then the payload (every layer's K and V of the block, as the
rank's cache holds them). The header repeats the fingerprint and the hash and carries
the payload's length and CRC-32, so a truncated, corrupt or misplaced file is detected
when it is read, and the request recomputes those tokens instead. Files are written
under a temporary name and renamed into place, so a crash mid-write leaves no file
under a block's name; a failed write removes its temporary file, and the next engine to
start over the directory removes those a killed one left.

Pure Python (the engine process scans the directory at start-up).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
import uuid
import zlib
from pathlib import Path

MAGIC = b"AIOLMKV1"
_HEADER = struct.Struct("<8s16s32sQI4x")  # magic, fingerprint, block hash, payload bytes, CRC-32
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"  # a file being written, renamed to its block's name once whole


class BlockFileError(ValueError):
    """A block file that cannot be used: missing, truncated, corrupt or another engine's."""


def fingerprint(parts: dict[str, object]) -> str:
    """A short name for a KV layout: the same ``parts`` give the same name in any process."""
    text = repr(sorted((k, repr(v)) for k, v in parts.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_signature(path: str) -> list[tuple[str, int, int]]:
    """What identifies a model's files without reading them: each file's name, size and
    modification time (a folder's top-level files, or the one file)."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p] if p.exists() else []
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def rank_dir(disk_path: str, fp: str, rank: int) -> Path:
    return Path(disk_path) / fp / f"rank{rank}"


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def existing_blocks(disk_path: str, fp: str) -> list[bytes]:
    """Hashes of rank 0's block files, least recently written first (the disk tier's LRU
    order when an engine starts over a directory that earlier engines filled)."""
    d = rank_dir(disk_path, fp, 0)
    if not d.is_dir():
        return []
    _sweep_partial_writes(d.parent)
    found = []
    for entry in os.scandir(d):
        name = entry.name
        if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
            continue
        try:
            h = bytes.fromhex(name[:64])
            found.append((entry.stat().st_mtime_ns, h))
        except (ValueError, OSError):
            continue
    found.sort()
    return [h for _, h in found]


def _sweep_partial_writes(layout_dir: Path) -> None:
    """Remove the temporary files of writes a killed engine left half done, in every rank's
    folder (those older than a minute: an engine sharing the folder may be writing one now)."""
    stale = time.time() - 60.0
    for rank in layout_dir.glob("rank*"):
        for tmp in rank.glob("*" + TMP_SUFFIX):
            with contextlib.suppress(OSError):
                if tmp.stat().st_mtime < stale:
                    tmp.unlink()


def pack(fp: str, block_hash: bytes, payload: memoryview | bytes) -> bytes:
    """The header for ``payload``."""
    return _HEADER.pack(MAGIC, bytes.fromhex(fp), block_hash, len(payload), zlib.crc32(payload))


def write_block(path: Path, fp: str, block_hash: bytes, payload: memoryview | bytes) -> None:
    """Write the block's file atomically (a temporary name, then a rename)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(pack(fp, block_hash, payload))
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:  # a full disk: the part written is no block, and would hold its space
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_block(path: Path, fp: str, block_hash: bytes, payload_bytes: int) -> bytearray:
    """The payload of the block's file, checked against its header; BlockFileError says
    why it cannot be used."""
    payload = bytearray(payload_bytes)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) < HEADER_BYTES:
                raise BlockFileError(f"{path.name}: truncated header")
            magic, file_fp, file_hash, length, crc = _HEADER.unpack(head)
            if magic != MAGIC:
                raise BlockFileError(f"{path.name}: not an aiolm KV block file")
            if file_fp != bytes.fromhex(fp) or file_hash != block_hash:
                raise BlockFileError(f"{path.name}: written for another model, layout or block")
            if length != payload_bytes:
                raise BlockFileError(
                    f"{path.name}: holds {length} bytes of KV, this engine's blocks have {payload_bytes}"
                )
            got = f.readinto(payload)
    except OSError as e:
        raise BlockFileError(f"{path.name}: {e.strerror}") from None
    if got != payload_bytes:
        raise BlockFileError(f"{path.name}: truncated ({got} of {payload_bytes} bytes)")
    if zlib.crc32(payload) != crc:
        raise BlockFileError(f"{path.name}: checksum mismatch")
    return payload
