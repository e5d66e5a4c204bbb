"""The conversion cache: a GGUF file becomes a Hugging Face-shaped folder once, shared by
every process and every copy of the same file.

Folders are keyed by the GGUF's content (sha256), so another checkout or virtual
environment with the same file finds the same folder. A conversion writes into a private
temporary folder and renames it into place: readers see all of a folder or none of it,
and when two processes convert at once the first rename wins and the other's copy goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

_CACHE_FORMAT = 1


def cache_root() -> Path:
    env = os.environ.get("AIOLM_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiolm"


def gguf_content_hash(gguf_path: Path) -> str:
    """sha256 of the file's bytes, hashed once per (path, size, mtime) and remembered."""
    st = gguf_path.stat()
    stamp = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = cache_root() / "gguf-hashes.json"
    known = _read_hash_index(index_path)
    if stamp in known:
        return known[stamp]
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    known = {**_read_hash_index(index_path), stamp: digest}  # re-read: another process may have added some
    index_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gguf-hashes.", dir=index_path.parent)
    with os.fdopen(fd, "w") as out:
        json.dump(known, out)
    os.replace(tmp, index_path)  # atomic; a lost race only costs hashing again later
    return digest


def _read_hash_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def gguf_cache_folder(gguf_path: Path) -> Path:
    """The converted folder of ``gguf_path``, converting it first if no process has yet."""
    key = hashlib.sha256(f"{gguf_content_hash(gguf_path)}|{_CACHE_FORMAT}".encode()).hexdigest()[:16]
    final = cache_root() / f"gguf-{key}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        from aiolm.checkpoint.gguf_convert import convert_gguf, progress

        progress("converting %s to float32 safetensors in %s (once)", gguf_path, final)
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, final)  # atomic: readers see all of the folder or none of it
        except OSError:
            if not (final / "config.json").exists():
                raise
            # another process finished first; its folder is equally good
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
