"""Quant methods: how a linear layer holds and multiplies its weight (base.py says the
contract). A new method is one module here and one line in ``QUANT_CONFIGS``; a platform
(or a checkpoint's format) names the one a model gets, and the builder hands it to the
model in its BuildContext.
"""

from __future__ import annotations

import importlib
from typing import Any

from aiolm.quant.base import LinearMethod, LinearSpec, QuantConfig

# name -> "module:QuantConfig subclass"; a module is imported only when its method is chosen.
QUANT_CONFIGS = {
    "dense": "aiolm.quant.dense:DenseConfig",
    "cpu_packed": "aiolm.quant.cpu_packed:CpuPackedConfig",
    "gguf_blocks": "aiolm.quant.gguf_blocks:GGUFBlocksConfig",
    "int4_blocks": "aiolm.quant.int4_blocks:Int4BlocksConfig",
    "triton_quant": "aiolm.quant.triton_quant:TritonQuantConfig",
}


def quant_config(name: str, **options: Any) -> QuantConfig:
    """The quant config ``name`` built with ``options`` (each class says which it takes)."""
    if name not in QUANT_CONFIGS:
        raise ValueError(f"quant method {name!r} is not known; known: {', '.join(QUANT_CONFIGS)}")
    module, _, cls = QUANT_CONFIGS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)


__all__ = ["QUANT_CONFIGS", "LinearMethod", "LinearSpec", "QuantConfig", "quant_config"]
