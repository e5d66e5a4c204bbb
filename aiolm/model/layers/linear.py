"""Linear layers shaped for tensor parallelism, each multiplying through its quant method.

Column-parallel layers split their output features across ranks (QKV, gate/up);
row-parallel ones split their input features and end in an all-reduce (o, down).
Fused layers load each Hugging Face shard into its slice via ``load_shard``, which
indexes the loaded tensor only where this rank's slice lies (a ``LazyWeight`` from
model/loader.py then reads nothing else).

A layer gets its quant method from the build context when it is constructed (aiolm/quant/
base.py): the method creates the weight the loader fills, lays it out after loading and
does the multiply. ``names`` are the checkpoint tensors fused into the layer, which a
method that reads its own copy of them (a GGUF file's blocks) looks up.

A model built with LoRA (aiolm/lora/layers.py) gives each layer an adapter may target
LoRA slots too, one slice per fused tensor; ``lora_pair`` cuts an adapter's A and B to
this rank's share the way ``load_shard`` cuts the weight, and the adapters' output is
added before a row-parallel layer's all-reduce (the sum of the ranks' partial products
is the whole product).
"""

from __future__ import annotations

import torch
from torch import nn

from aiolm.distributed.sharding import kv_head_for_rank
from aiolm.lora.adapter import TARGETS
from aiolm.lora.layers import LoRASlots
from aiolm.model.layers.activation import ACTIVATIONS
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.weights import copy_weight
from aiolm.quant.base import LinearMethod, LinearSpec


class LinearBase(nn.Module):
    """A linear layer whose weight and multiply belong to ``quant_method``."""

    weight: nn.Parameter
    quant_method: LinearMethod
    lora: LoRASlots | None

    def _take_method(self, ctx: BuildContext, spec: LinearSpec, in_features: int, slices: list[int]) -> None:
        """The quant method and its weight [sum(slices), in_features]; LoRA slots with one
        slice per fused tensor where the model is built with LoRA and an adapter may target
        every tensor of this layer."""
        self.quant_method = ctx.quant.linear_method(spec)
        self.quant_method.create_weights(self, in_features, sum(slices))
        targetable = bool(spec.names) and all(n.rsplit(".", 1)[-1] in TARGETS for n in spec.names)
        self.lora = None
        if ctx.lora is not None and targetable and not spec.lm_head:
            self.lora = LoRASlots(ctx.lora, in_features, slices, spec.names)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
        """activation(x W^T + b (+ the LoRA term)), ``activation`` a hidden_act name: inside
        the kernel where the method can and no adapter's term comes between."""
        lora = self.lora is not None and self.lora.ctx.active
        if activation is not None and not lora and self.quant_method.fuses(self, activation):
            return self.quant_method.apply(self, x, bias, activation=activation)
        y = self.quant_method.apply(self, x, bias)
        if lora:
            self.lora.add_to(y, x)
        return y if activation is None else ACTIVATIONS[activation](y)


class ColumnParallelLinear(LinearBase):
    """y = x W^T (+ b) with W's rows (outputs) split across ranks; shards laid side by side."""

    # The op after this layer reads its output as it comes (the activation of gate/up)
    output_to_kernel = True

    def __init__(
        self,
        ctx: BuildContext,
        in_features: int,
        shard_sizes: list[int],
        bias: bool = False,
        names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        tp = ctx.tp_group
        for s in shard_sizes:
            if s % tp.world_size:
                raise ValueError(f"output size {s} not divisible by tensor parallel size {tp.world_size}")
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.full_sizes = list(shard_sizes)
        self.local_sizes = [s // tp.world_size for s in shard_sizes]
        out = sum(self.local_sizes)
        spec = LinearSpec(names, output_to_kernel=self.output_to_kernel)
        self._take_method(ctx, spec, in_features, self.local_sizes)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """This rank's outputs, through ``activation`` (a hidden_act name) if given."""
        return self._matmul(x, self.bias, activation)

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """Copy this rank's part of Hugging Face tensor ``shard`` into its slice."""
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"no {name} in this layer"
        start = sum(self.local_sizes[:shard])
        copy_weight(param.data[start : start + self.local_sizes[shard]], self.local_rows(loaded, shard, name), name)

    def local_rows(self, loaded: torch.Tensor, shard: int, name: str = "weight") -> torch.Tensor:
        """This rank's rows of a tensor with Hugging Face tensor ``shard``'s output rows."""
        n = self.local_sizes[shard]
        if loaded.shape[0] != self.full_sizes[shard]:
            raise ValueError(f"{name} shard {shard}: expected {self.full_sizes[shard]} rows, got {loaded.shape[0]}")
        return loaded[self.tp_rank * n : (self.tp_rank + 1) * n]

    def lora_pair(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of an adapter's (A [r, in], B [out, r]) for tensor ``shard``:
        the input is whole here, so A whole; B's rows as the weight's."""
        return a, self.local_rows(b, shard, "lora_B")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when there are fewer than ranks
    (distributed/sharding.py says which one a rank holds)."""

    def __init__(
        self,
        ctx: BuildContext,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        names: tuple[str, ...] = (),
        output_to_kernel: bool = False,
    ) -> None:
        # q, k, v usually go to RoPE first; an encoder without it hands them straight to
        # its attention (output_to_kernel)
        self.output_to_kernel = output_to_kernel
        tp = ctx.tp_group.world_size
        if num_kv_heads < tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over tensor parallel size {tp}")
        self.kv_replicas = max(1, tp // num_kv_heads)
        kv_global = max(num_kv_heads, tp) * head_dim
        super().__init__(ctx, hidden, [num_heads * head_dim, kv_global, kv_global], bias, names)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def local_rows(self, loaded: torch.Tensor, shard: int, name: str = "weight") -> torch.Tensor:
        if shard == 0 or self.kv_replicas == 1:
            return super().local_rows(loaded, shard, name)
        d = self.head_dim
        if loaded.shape[0] != self.num_kv_heads * d:
            raise ValueError(f"{name} shard {shard}: expected {self.num_kv_heads * d} rows, got {loaded.shape[0]}")
        head = kv_head_for_rank(self.tp_rank, self.tp_size, self.num_kv_heads)[0]
        return loaded[head * d : (head + 1) * d]


class RowParallelLinear(LinearBase):
    """y = all_reduce(x_local W_local^T): each rank holds a slice of the input features."""

    def __init__(
        self, ctx: BuildContext, in_features: int, out_features: int, bias: bool = False, names: tuple[str, ...] = ()
    ) -> None:
        super().__init__()
        tp = ctx.tp_group
        if in_features % tp.world_size:
            raise ValueError(f"input size {in_features} not divisible by tensor parallel size {tp.world_size}")
        self.tp = tp
        self.local_in = in_features // tp.world_size
        # with one rank the output goes straight into the fused residual norm; with more,
        # into the all-reduce first
        spec = LinearSpec(names, output_to_kernel=tp.world_size == 1)
        self._take_method(ctx, spec, self.local_in, [out_features])
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias goes into one rank's partial sum, so the all-reduce adds it once, and
        # the kernel adds it where it writes y instead of in a pass of its own
        return self.tp.all_reduce(self._matmul(x, self.bias if self.tp.rank == 0 else None))

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if name == "bias":
            if self.bias is None:
                raise ValueError("a bias, which this layer does not have")
            copy_weight(self.bias.data, loaded[...], name)
            return
        copy_weight(self.weight.data, self._local_columns(loaded), name)

    def _local_columns(self, loaded: torch.Tensor) -> torch.Tensor:
        r, whole = self.tp.rank, self.local_in * self.tp.world_size
        if len(loaded.shape) != 2 or loaded.shape[1] != whole:  # a slice would hide a wrong width
            raise ValueError(f"expected {whole} input columns, got shape {tuple(loaded.shape)}")
        return loaded[:, r * self.local_in : (r + 1) * self.local_in]

    def lora_pair(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of an adapter's (A [r, in], B [out, r]): A's columns as the
        weight's (x arrives split); B whole, its partial product summed by the all-reduce."""
        return self._local_columns(a), b
