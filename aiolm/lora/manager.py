"""A worker's adapters: which one sits in which slot, and the ones kept in host memory.

The model has ``max_loras`` slots in every LoRA layer (aiolm/lora/layers.py). Before a
step, ``slots_for`` gives each adapter the step uses a slot: the one it holds already, else
a free slot or the least recently used slot of an adapter this step does not use (the
scheduler never puts more than ``max_loras`` adapters in one step, so there is one), and
writes the adapter's matrices into every layer's slot. Adapters come from a host cache of
up to ``max_cpu_loras`` (least recently used leaves first) or, when not there, from their
folder, read and cut to this rank's share of each layer (``lora_pair`` of the layer).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

import torch
from safetensors.torch import load_file
from torch import nn

from aiolm.checkpoint.config import ModelConfig
from aiolm.lora.adapter import read_adapter, served_name
from aiolm.lora.layers import LoRAContext, LoRASlots
from aiolm.lora.request import LoRARequest

log = logging.getLogger(__name__)

# One adapter as this rank holds it: module name -> (A [r, in_local], scaled B [out_local, r])
Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRALoadError(RuntimeError):
    """An adapter accepted earlier cannot be read now (its folder changed or went away)."""


class LoRAManager:
    """The slots and host cache of one model built with LoRA (``build_model(lora=...)``)."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, max_cpu_loras: int) -> None:
        self.model_config = model_config
        self.max_cpu_loras = max(1, max_cpu_loras)
        self.layers: list[tuple[nn.Module, LoRASlots]] = []
        self.target: dict[str, tuple[nn.Module, int]] = {}  # module name -> (layer, its slice)
        for m in model.modules():
            slots = getattr(m, "lora", None)
            if isinstance(slots, LoRASlots):
                self.layers.append((m, slots))
                for i, name in enumerate(slots.names):
                    self.target[name] = (m, i)
        if not self.layers:
            raise ValueError(f"{model_config.architecture}: no layer of this model takes LoRA adapters")
        self.ctx: LoRAContext = self.layers[0][1].ctx
        self.slot_ids: list[int | None] = [None] * self.ctx.max_loras  # the adapter id in each slot
        self.slot_use: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.host: OrderedDict[int, Weights] = OrderedDict()
        self.loads = 0  # adapters read from their folders (tests count reloads)

    def slots_for(self, adapters: Iterable[LoRARequest]) -> tuple[dict[int, int], dict[int, str]]:
        """For one step's adapters: id -> slot, writing in those not in a slot yet; and id ->
        why, for those whose folder cannot be read (they get no slot)."""
        wanted = {a.lora_int_id: a for a in adapters}
        if len(wanted) > self.ctx.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; the model has {self.ctx.max_loras} slots")
        out: dict[int, int] = {}
        failed: dict[int, str] = {}
        for lid in wanted:
            if lid in self.slot_ids:
                out[lid] = self.slot_ids.index(lid)
        for lid, req in wanted.items():
            if lid in out:
                continue
            try:
                weights = self._weights(req)
            except LoRALoadError as e:
                log.warning("%s", e)
                failed[lid] = str(e)
                continue
            slot = self._free_slot(set(out.values()))
            self._write(slot, weights)
            self.slot_ids[slot] = lid
            out[lid] = slot
        for slot in out.values():
            self.slot_use.pop(slot, None)
            self.slot_use[slot] = None
        return out, failed

    def remove(self, lora_id: int) -> None:
        """Forget an unloaded adapter: its slot is cleared, its host copy dropped."""
        self.host.pop(lora_id, None)
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            for _, slots in self.layers:
                slots.clear(slot)
            self.slot_ids[slot] = None
            self.slot_use.pop(slot, None)

    def _free_slot(self, taken: set[int]) -> int:
        for slot, lid in enumerate(self.slot_ids):
            if lid is None and slot not in taken:
                return slot
        for slot in self.slot_use:  # least recently used first
            if slot not in taken:
                self.slot_use.pop(slot)
                return slot
        raise RuntimeError("no LoRA slot is free")  # unreachable: the step's adapters fit

    def _write(self, slot: int, weights: Weights) -> None:
        for _, slots in self.layers:
            slots.write(slot, [weights.get(name) for name in slots.names])

    def _weights(self, req: LoRARequest) -> Weights:
        lid = req.lora_int_id
        w = self.host.pop(lid, None)
        if w is None:
            w = self.load(req)
        self.host[lid] = w  # most recently used last
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return w

    def load(self, req: LoRARequest) -> Weights:
        """The adapter's matrices cut to this rank's share, B scaled; read from its folder."""
        try:
            info = read_adapter(req.lora_path, self.model_config, self.ctx.max_rank)
            tensors = load_file(str(info.weights_file))
        except Exception as e:  # ParamError, OSError, safetensors' own: the request fails, not the worker
            raise LoRALoadError(f"adapter {req.lora_name!r} ({req.lora_path}) cannot be loaded: {e}") from None
        bad = next((k for k, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())), None)
        if bad is not None:
            raise LoRALoadError(f"adapter {req.lora_name!r} ({req.lora_path}): tensor {bad} holds NaN or infinity")
        by_module = {served_name(k): v for k, v in tensors.items()}
        out: Weights = {}
        for module, m in info.modules.items():
            if module not in self.target:
                raise LoRALoadError(f"adapter {req.lora_name!r}: {module} has no LoRA slots in this model")
            layer, shard = self.target[module]
            try:  # a file that changed since its header was checked: the request fails, not the worker
                a = by_module[f"{module}.lora_A.weight"].float()
                b = by_module[f"{module}.lora_B.weight"].float() * m.scaling
                a, b = layer.lora_pair(shard, a, b)  # type: ignore[operator]
            except (KeyError, RuntimeError, ValueError) as e:
                raise LoRALoadError(f"adapter {req.lora_name!r}: {module} cannot be used: {e}") from None
            out[module] = (a.contiguous(), b.contiguous())
        self.loads += 1
        log.info("loaded LoRA adapter %r (id %d) from %s", req.lora_name, req.lora_int_id, req.lora_path)
        return out
