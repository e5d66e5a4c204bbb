"""LoRA adapters served over one base model: many adapters in one batch, each row its own.

``request.py`` names an adapter; ``adapter.py`` reads and checks a PEFT folder without
torch (the engine process does it before a request or a load is accepted); ``layers.py``
holds the per-layer slots and the per-step row mapping the linear layers read;
``manager.py`` is the worker's side: which adapter sits in which slot, an LRU host cache,
loading the tensors sliced for this rank.
"""

from aiolm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
