"""The conversion cache: a GGUF file becomes a Hugging Face-shaped folder once, shared by
every process and every copy of the same file.

Folders are keyed by the GGUF's content (sha256), so another checkout or virtual
environment with the same file finds the same folder. A conversion writes into a private
temporary folder and renames it into place: readers see all of a folder or none of it,
and when two processes convert at once the first rename wins and the other's copy goes.

The conversion itself runs in a child process (``python -m aiolm.checkpoint.gguf_convert``):
it holds every dequantized float32 tensor at once, and building the tokenizer from GGUF
metadata imports torch through transformers; neither belongs in a long-lived server's
heap. Its progress lines are relayed to this process's ``progress``; its refusal comes
back as the same ModelLoadError message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from aiolm.errors import ModelLoadError

# Raised when a conversion's output changes (2: rope scaling and end-of-turn ids for every architecture;
# 3: special tokens at their own ids, the end-of-generation tokens llama.cpp knows by their text)
_CACHE_FORMAT = 3


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


def _folder(content_hash: str, cache_format: int) -> Path:
    key = hashlib.sha256(f"{content_hash}|{cache_format}".encode()).hexdigest()[:16]
    return cache_root() / f"gguf-{key}"


def gguf_cache_folder(gguf_path: Path) -> Path:
    """The converted folder of ``gguf_path``, converting it first if no process has yet."""
    content = gguf_content_hash(gguf_path)
    final = _folder(content, _CACHE_FORMAT)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        from aiolm.checkpoint.gguf_convert import progress

        progress("converting %s to float32 safetensors in %s (once)", gguf_path, final)
        _convert_in_child(gguf_path, tmp)
        try:
            os.rename(tmp, final)  # atomic: readers see all of the folder or none of it
        except OSError:
            if not (final / "config.json").exists():
                raise
            # another process finished first; its folder is equally good
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in range(1, _CACHE_FORMAT):  # the same file's conversions of earlier formats: float32
        stale = _folder(content, old)  # copies as big as the model, read by nothing now
        if stale.exists():
            progress("removing %s, %s converted by an earlier aiolm", stale, gguf_path.name)
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _convert_in_child(gguf_path: Path, out_dir: Path) -> None:
    """gguf_convert.convert_gguf(gguf_path, out_dir), run by ``python -m`` in a child."""
    from aiolm.checkpoint.gguf_convert import PROGRESS_PREFIX, REFUSAL_PREFIX, progress

    proc = subprocess.Popen(
        [sys.executable, "-m", "aiolm.checkpoint.gguf_convert", str(gguf_path), str(out_dir)],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    refusal, other = None, []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(PROGRESS_PREFIX):
                progress("%s", line[len(PROGRESS_PREFIX) :].rstrip("\n"))
            elif line.startswith(REFUSAL_PREFIX):
                refusal = json.loads(line[len(REFUSAL_PREFIX) :])
            else:
                other.append(line)
                sys.stderr.write(line)  # transformers' warnings, as if it had run here
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = "".join(other[-20:]).strip()
        raise ModelLoadError(
            refusal or f"{gguf_path}: the conversion process failed (exit code {proc.returncode}): {tail}"
        )
