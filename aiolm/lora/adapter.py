"""A PEFT LoRA folder read and checked against the base model, without torch.

The engine process checks an adapter before it accepts it (``--lora-modules`` at start,
``/v1/load_lora_adapter``, a ``LoRARequest`` first seen by ``generate``): the folder's
``adapter_config.json`` for what aiolm serves, and the header of
``adapter_model.safetensors`` (its tensor names and shapes; no tensor data) for every
module's shapes against the model's. A problem is a ``ParamError`` naming it, so a bad
adapter is a 400 or a start-up error, never a worker failure in the middle of a step.
The workers then read the tensors (aiolm/lora/manager.py) through ``AdapterInfo``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiolm.checkpoint.config import ModelConfig
from aiolm.params import ParamError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by their Hugging Face names: each is one of the
# fused or plain linear layers of a decoder (aiolm/model/layers/linear.py)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_PREFIX = "base_model.model."
# Where a vision-language model's PEFT file names its language model's layers (transformers 5,
# then 4), and the decoder's own names that aiolm serves them as
_LANGUAGE_MODEL = ("model.language_model.", "language_model.model.")
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class ModuleLoRA:
    """One targeted projection: its rank and the scale its B is multiplied by."""

    rank: int
    scaling: float


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: the largest rank and each targeted module, by its Hugging Face
    name (``model.layers.3.self_attn.q_proj``)."""

    path: str
    rank: int
    modules: dict[str, ModuleLoRA]

    @property
    def weights_file(self) -> Path:
        return Path(self.path) / WEIGHTS_FILE


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every projection an adapter may target in this model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }
    return {f"model.layers.{n}.{k}": v for n in range(cfg.num_layers) for k, v in per_layer.items()}


def served_name(key: str) -> str:
    """A tensor's name in a PEFT file as aiolm names it: without PEFT's wrapper prefix, and a
    vision-language model's language-model layers as a decoder's (``model.layers.N...``)."""
    key = key.removeprefix(_PREFIX)
    for prefix in _LANGUAGE_MODEL:
        if key.startswith(prefix):
            return "model." + key[len(prefix) :]
    return key


def _header(path: Path) -> dict[str, Any]:
    """The safetensors header: tensor name -> {dtype, shape, data_offsets}."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ParamError("lora_path", f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ParamError("lora_path", f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ParamError("lora_path", f"{path}: cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ParamError("lora_path", f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ParamError("lora_path", f"{path}: not a safetensors file")
    header.pop("__metadata__", None)
    # the data must be all there: a cut file fails only where the worker reads it, in a step
    ends = []
    for name, meta in header.items():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ParamError("lora_path", f"{path}: not a safetensors file (tensor {name!r} has no data offsets)")
        ends.append(offsets[1])
    need = 8 + n + max(ends, default=0)
    size = path.stat().st_size
    if size < need:
        raise ParamError("lora_path", f"{path}: cut short ({size} bytes; its header says {need})")
    return header


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name, as
    a whole dotted suffix or as a regular expression of one (a key of alternatives such as
    ``q_proj|v_proj`` is one group, as PEFT reads it)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _number(cfg: dict[str, Any], name: str, default: Any, integer: bool = False) -> Any:
    """``cfg[name]`` (or ``default``): a number (an integer with ``integer``), or a ParamError naming it."""
    value = cfg.get(name, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        want = "an integer" if integer else "a number"
        raise ParamError("lora_path", f"{CONFIG_FILE}: {name} must be {want}, got {value!r}")
    return value


def _patterns(cfg: dict[str, Any], name: str, integer: bool) -> dict[str, Any]:
    """``cfg[name]``, a rank_pattern or alpha_pattern: regular expressions to numbers."""
    patterns = cfg.get(name) or {}
    if not isinstance(patterns, dict):
        raise ParamError("lora_path", f"{CONFIG_FILE}: {name} must map module patterns to numbers")
    for key in patterns:
        try:
            re.compile(key)
        except re.error as e:
            raise ParamError(
                "lora_path", f"{CONFIG_FILE}: {name} key {key!r} is not a regular expression ({e})"
            ) from None
        _number(patterns, key, None, integer)
    return patterns


def _refuse(cfg: dict[str, Any]) -> None:
    """What PEFT writes that aiolm does not serve, each with its reason."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ParamError("lora_path", f"peft_type {peft_type!r} is not served; only LORA adapters are")
    if cfg.get("modules_to_save"):
        raise ParamError(
            "lora_path",
            f"modules_to_save {cfg['modules_to_save']} are not served: they replace whole base layers "
            f"per adapter, which a batch shared between adapters cannot do",
        )
    # PEFT's LoRA variants, each a forward of its own, which the batched LoRA kernels do not run
    variants = {
        "use_dora": "DoRA adapters (use_dora)",
        "alora_invocation_tokens": "activated LoRA adapters (alora_invocation_tokens)",
        "use_qalora": "QALoRA adapters (use_qalora)",
        "use_bdlora": "block-diagonal LoRA adapters (use_bdlora)",
        "arrow_config": "Arrow routing adapters (arrow_config)",
        "monteclora_config": "MonteCLoRA adapters (monteclora_config)",
        "layer_replication": "adapters that replicate base layers (layer_replication)",
        "target_parameters": "adapters of parameters rather than linear layers (target_parameters)",
    }
    for name, what in variants.items():
        if cfg.get(name):
            raise ParamError("lora_path", f"{what} are not served")
    if cfg.get("lora_bias"):
        raise ParamError("lora_path", "adapters with LoRA biases (lora_bias) are not served")
    if cfg.get("bias", "none") != "none":
        raise ParamError("lora_path", f"bias {cfg['bias']!r} is not served; only bias 'none' is")
    if cfg.get("fan_in_fan_out"):
        raise ParamError("lora_path", "fan_in_fan_out adapters (Conv1D layers) are not served")
    if cfg.get("trainable_token_indices") or cfg.get("additional_vocab_size"):
        raise ParamError("lora_path", "adapters with extra or retrained vocabulary are not served")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and (init.lower().startswith("pissa") or init.lower() in ("olora", "corda", "loftq")):
        # PEFT rewrites the base weights to W - BA when it loads these: adding BA to the base gives
        # another model. PEFT converts such an adapter to a plain one (path_initial_model_for_weight_conversion).
        raise ParamError(
            "lora_path",
            f"init_lora_weights {init!r} adapters change the base weights as they load and are not served; "
            "convert the adapter to a plain LoRA with PEFT first",
        )


def read_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> AdapterInfo:
    """The adapter in the PEFT folder ``path``, checked against ``model`` and ``max_rank``
    (``--max-lora-rank``); ParamError("lora_path", ...) naming the problem otherwise."""
    try:
        folder = Path(path).expanduser()
    except RuntimeError:  # ~user of no such user
        raise ParamError("lora_path", f"{path}: no such folder (its home directory is unknown)") from None
    if not folder.is_dir():
        raise ParamError("lora_path", f"{path}: no such folder")
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise ParamError("lora_path", f"{path}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParamError("lora_path", f"{cfg_file}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ParamError("lora_path", f"{cfg_file}: not a JSON object")
    _refuse(cfg)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ParamError("lora_path", f"{path}: no {WEIGHTS_FILE} (found: {found})")
    shapes = module_shapes(model)
    tensors: dict[str, dict[str, list[int]]] = {}
    named: dict[str, str] = {}  # module -> its name in the file, which PEFT's patterns match
    for key, meta in _header(weights).items():
        m = _KEY.fullmatch(served_name(key))
        if m is None:
            raise ParamError(
                "lora_path",
                f"tensor {key!r} is not a LoRA A or B matrix of a linear layer "
                f"(embedding, extra-vocabulary and saved base modules are not served)",
            )
        module = m.group("module")
        if module.rsplit(".", 1)[-1] not in TARGETS:
            raise ParamError(
                "lora_path", f"target module {module!r} is not served; LoRA targets one of {', '.join(TARGETS)}"
            )
        if module not in shapes:
            raise ParamError("lora_path", f"target module {module!r} is not a layer of this model")
        tensors.setdefault(module, {})[m.group("ab")] = list(meta.get("shape", []))
        named[module] = key.removeprefix(_PREFIX).rsplit(".lora_", 1)[0]
    if not tensors:
        raise ParamError("lora_path", f"{weights}: holds no LoRA tensors")
    r_said = _number(cfg, "r", 8, integer=True)
    alpha = _number(cfg, "lora_alpha", 8)  # LoraConfig's default
    rank_pattern = _patterns(cfg, "rank_pattern", integer=True)
    alpha_pattern = _patterns(cfg, "alpha_pattern", integer=False)
    rslora = bool(cfg.get("use_rslora", False))
    modules: dict[str, ModuleLoRA] = {}
    for module, ab in sorted(tensors.items()):
        if set(ab) != {"A", "B"}:
            raise ParamError("lora_path", f"{module}: has lora_{next(iter(ab))} but not its other half")
        (a, b), (k, n) = (ab["A"], ab["B"]), shapes[module]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise ParamError("lora_path", f"{module}: lora_A {a} and lora_B {b} are not a rank-r pair")
        r = a[0]
        if a[1] != k or b[0] != n:
            raise ParamError(
                "lora_path",
                f"{module}: the adapter maps {a[1]} -> {b[0]} features, the model's layer {k} -> {n} "
                f"(an adapter for another base model?)",
            )
        if r > max_rank:
            raise ParamError("lora_path", f"{module}: rank {r} is above --max-lora-rank {max_rank}")
        if r < 1:
            raise ParamError("lora_path", f"{module}: rank {r}")
        said = _pattern_value(rank_pattern, named[module], r_said if "r" in cfg else r)
        if said != r:  # PEFT refuses such a file too: the scaling would be alpha over the wrong rank
            raise ParamError("lora_path", f"{module}: its tensors have rank {r}, {CONFIG_FILE} says {said}")
        a_m = float(_pattern_value(alpha_pattern, named[module], alpha))
        modules[module] = ModuleLoRA(r, a_m / (math.sqrt(r) if rslora else r))
    return AdapterInfo(str(folder), max(m.rank for m in modules.values()), modules)
