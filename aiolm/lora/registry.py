"""The engine's adapters: the ones served by name, and every adapter a request brought.

``--lora-modules`` and ``/v1/load_lora_adapter`` add served adapters (clients pick one by
passing its name as the model); ``LLM.generate(lora_request=...)`` may also bring its own
``LoRARequest``. Each adapter is checked once (aiolm/lora/adapter.py), by its id, before a
request that uses it is accepted; removing a served adapter only stops new requests
naming it (requests already in keep their ``LoRARequest`` and finish). Torch-free.
"""

from __future__ import annotations

import asyncio

from aiolm.checkpoint.config import ModelConfig
from aiolm.lora.adapter import AdapterInfo, read_adapter
from aiolm.lora.request import LoRARequest
from aiolm.params import ParamError


class UnknownAdapterError(ParamError):
    """No served adapter has the name (a 404 on the API)."""


class LoRARegistry:
    def __init__(self, model: ModelConfig, base_name: str, max_rank: int) -> None:
        self.model = model
        self.base_name = base_name
        self.max_rank = max_rank
        self.served: dict[str, LoRARequest] = {}
        # every id ever used, for good: the workers cache adapters by id, so an id never
        # names a second adapter (a reloaded one gets a new id)
        self._checked: dict[int, tuple[LoRARequest, AdapterInfo]] = {}
        self._issued = 0  # the last id new_request gave: loads at once must not share one

    def check_now(self, lora: LoRARequest) -> AdapterInfo:
        """``lora`` checked (once per id); the same id with another name or folder is refused."""
        seen = self._checked.get(lora.lora_int_id)
        if seen is not None:
            if seen[0] != lora:
                raise ParamError(
                    "lora_int_id",
                    f"{lora.lora_int_id} already names adapter {seen[0].lora_name!r} at {seen[0].lora_path}",
                )
            return seen[1]
        info = read_adapter(lora.lora_path, self.model, self.max_rank)
        self._checked[lora.lora_int_id] = (lora, info)
        return info

    async def check(self, lora: LoRARequest) -> AdapterInfo:
        """``check_now`` off the event loop when the folder has not been read yet."""
        seen = self._checked.get(lora.lora_int_id)
        if seen is not None and seen[0] == lora:
            return seen[1]
        info = await asyncio.to_thread(read_adapter, lora.lora_path, self.model, self.max_rank)
        seen = self._checked.get(lora.lora_int_id)
        if seen is not None and seen[0] != lora:
            return self.check_now(lora)  # raises: the id was taken meanwhile
        self._checked[lora.lora_int_id] = (lora, info)
        return info

    def next_id(self) -> int:
        """An id no adapter has, nor any load still reading its folder."""
        self._issued = max(self._issued, max(self._checked, default=0)) + 1
        return self._issued

    def new_request(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """A LoRARequest for a new served adapter ``name`` (with ``replace``, maybe one served
        now), with a fresh id."""
        if name == self.base_name:
            raise ParamError("lora_name", f"{name!r} is the base model's name")
        if name in self.served and not replace:
            raise ParamError("lora_name", f"an adapter named {name!r} is already loaded")
        return LoRARequest(name, self.next_id(), path)

    def add(self, lora: LoRARequest, replace: bool = False) -> None:
        """Serve a checked adapter under its name (with ``replace``, in place of the one
        served under it: requests already in finish with that one)."""
        if lora.lora_name == self.base_name:
            raise ParamError("lora_name", f"{lora.lora_name!r} is the base model's name")
        if lora.lora_name in self.served and not replace:
            raise ParamError("lora_name", f"an adapter named {lora.lora_name!r} is already loaded")
        self.check_now(lora)
        self.served[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.served.pop(name, None)
        if lora is None:
            raise UnknownAdapterError("lora_name", f"no adapter named {name!r} is loaded")
        return lora

    def get(self, name: str) -> LoRARequest | None:
        return self.served.get(name)
