"""aiolm: an LLM inference and serving engine on one uvloop event loop.

Names are imported lazily so ``import aiolm.core.scheduler`` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngine": "aiolm.engine.async_engine",
    "LLM": "aiolm.engine.llm",
    "EngineArgs": "aiolm.config",
    "SamplingParams": "aiolm.params",
    "BeamSearchParams": "aiolm.params",
    "PoolingParams": "aiolm.pooling.params",
    "LoRARequest": "aiolm.lora.request",
    "OutputKind": "aiolm.params",
    "ParamError": "aiolm.params",
    "RequestOutput": "aiolm.outputs",
    "PoolingRequestOutput": "aiolm.outputs",
    "CompletionOutput": "aiolm.outputs",
    "Logprob": "aiolm.outputs",
    "EngineDeadError": "aiolm.engine.errors",
    "RequestError": "aiolm.engine.errors",
    "EngineBusyError": "aiolm.engine.errors",
    "EngineRecoveringError": "aiolm.engine.errors",
    "RequestTimeoutError": "aiolm.engine.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aiolm' has no attribute {name!r}")
