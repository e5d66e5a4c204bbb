"""LoRARequest: which adapter a request runs with, as vLLM's users name one.

It crosses to the workers inside NewRequestData (aiolm/core/step.py): each rank loads
the folder itself, the first time a step needs the adapter and after it was evicted, so
only the name, id and path travel. Torch-free.
"""

from __future__ import annotations

import msgspec

from aiolm.params import ParamError


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """``lora_name``: what clients pass as ``model``; ``lora_int_id``: a positive integer
    unique among the adapters served (the workers key their slots and caches by it);
    ``lora_path``: a PEFT folder (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ParamError("lora_name", "must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ParamError("lora_int_id", f"must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ParamError("lora_path", "must be the path of a PEFT adapter folder")
