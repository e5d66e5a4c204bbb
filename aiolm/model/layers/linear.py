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
"""

from __future__ import annotations

import torch
from torch import nn

from aiolm.distributed.sharding import kv_head_for_rank
from aiolm.model.layers.context import BuildContext
from aiolm.quant.base import LinearMethod, LinearSpec


class LinearBase(nn.Module):
    """A linear layer whose weight and multiply belong to ``quant_method``."""

    weight: nn.Parameter
    quant_method: LinearMethod

    def _take_method(self, ctx: BuildContext, spec: LinearSpec, in_features: int, out_features: int) -> None:
        self.quant_method = ctx.quant.linear_method(spec)
        self.quant_method.create_weights(self, in_features, out_features)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)


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
        self._take_method(ctx, LinearSpec(names, output_to_kernel=self.output_to_kernel), in_features, out)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """Copy this rank's part of Hugging Face tensor ``shard`` into its slice."""
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"no {name} in this layer"
        n = self.local_sizes[shard]
        if loaded.shape[0] != self.full_sizes[shard]:
            raise ValueError(f"{name} shard {shard}: expected {self.full_sizes[shard]} rows, got {loaded.shape[0]}")
        start = sum(self.local_sizes[:shard])
        param.data[start : start + n].copy_(loaded[self.tp_rank * n : (self.tp_rank + 1) * n])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when there are fewer than ranks
    (distributed/sharding.py says which one a rank holds)."""

    output_to_kernel = False  # q, k, v go to RoPE and attention

    def __init__(
        self,
        ctx: BuildContext,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        names: tuple[str, ...] = (),
    ) -> None:
        tp = ctx.tp_group.world_size
        if num_kv_heads < tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over tensor parallel size {tp}")
        self.kv_replicas = max(1, tp // num_kv_heads)
        kv_global = max(num_kv_heads, tp) * head_dim
        super().__init__(ctx, hidden, [num_heads * head_dim, kv_global, kv_global], bias, names)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if shard == 0 or self.kv_replicas == 1:
            return super().load_shard(name, loaded, shard)
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"no {name} in this layer"
        d = self.head_dim
        if loaded.shape[0] != self.num_kv_heads * d:
            raise ValueError(f"{name} shard {shard}: expected {self.num_kv_heads * d} rows, got {loaded.shape[0]}")
        head = kv_head_for_rank(self.tp_rank, self.tp_size, self.num_kv_heads)[0]
        start = sum(self.local_sizes[:shard])
        param.data[start : start + d].copy_(loaded[head * d : (head + 1) * d])


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
        self._take_method(ctx, spec, self.local_in, out_features)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._matmul(x))
        return y if self.bias is None else y + self.bias

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if name == "bias":
            assert self.bias is not None
            self.bias.data.copy_(loaded[...])
            return
        r = self.tp.rank
        self.weight.data.copy_(loaded[:, r * self.local_in : (r + 1) * self.local_in])
