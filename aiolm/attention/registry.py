"""The attention backends by name: a new backend is one module under aiolm/attention/
and one line here. A platform lists the names it can run (``Platform.attention_backends``);
the builder hands the class it picks to the model in its BuildContext.
"""

from __future__ import annotations

import importlib

# --attention-backend names -> "module:Class"; a module is imported only when its backend is chosen.
BACKENDS = {
    "cpu": "aiolm.attention.cpu_backend:CpuPagedAttention",
    "torch": "aiolm.attention.torch_backend:TorchAttention",
    "triton": "aiolm.attention.triton_backend:TritonAttention",
}


def backend_class(name: str) -> type:
    """The class of backend ``name``; ImportError where its module cannot load (triton missing)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not known; known: auto, {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
