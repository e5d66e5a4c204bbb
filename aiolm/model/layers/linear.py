"""Linear layers shaped for tensor parallelism.

Column-parallel layers split their output features across ranks (QKV, gate/up);
row-parallel ones split their input features and end in an all-reduce (o, down).
Fused layers load each Hugging Face shard into its slice via ``load_shard``, which
indexes the loaded tensor only where this rank's slice lies (a ``LazyWeight`` from
model/loader.py then reads nothing else).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from aiolm.distributed.parallel_state import get_tp_group
from aiolm.distributed.sharding import kv_head_for_rank

LinearMethod = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class PackableLinear(nn.Module):
    """A linear layer whose multiply the platform may replace once weights are loaded.

    ``method(x, bias)`` is set by the platform's weight preparation (a packed layout, a
    quantized copy); until then, or where it sets none, the layer multiplies by its plain
    weight. Its output dtype is the method's business: the layer only passes it on."""

    weight: nn.Parameter
    method: LinearMethod | None = None

    def dense(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.method is not None:
            return self.method(x, bias)
        return self.dense(x, bias)


class ColumnParallelLinear(PackableLinear):
    """y = x W^T (+ b) with W's rows (outputs) split across ranks; shards laid side by side."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        for s in shard_sizes:
            if s % tp.world_size:
                raise ValueError(f"output size {s} not divisible by tensor parallel size {tp.world_size}")
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.full_sizes = list(shard_sizes)
        self.local_sizes = [s // tp.world_size for s in shard_sizes]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
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
        param.data[start:start + n].copy_(loaded[self.tp_rank * n:(self.tp_rank + 1) * n])


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when there are fewer than ranks
    (distributed/sharding.py says which one a rank holds)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = get_tp_group().world_size
        if num_kv_heads < tp and tp % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over tensor parallel size {tp}")
        self.kv_replicas = max(1, tp // num_kv_heads)
        kv_global = max(num_kv_heads, tp) * head_dim
        super().__init__(hidden, [num_heads * head_dim, kv_global, kv_global], bias)
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
        param.data[start:start + d].copy_(loaded[head * d:(head + 1) * d])


class RowParallelLinear(PackableLinear):
    """y = all_reduce(x_local W_local^T): each rank holds a slice of the input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_group()
        if in_features % tp.world_size:
            raise ValueError(f"input size {in_features} not divisible by tensor parallel size {tp.world_size}")
        self.tp = tp
        self.local_in = in_features // tp.world_size
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
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
        self.weight.data.copy_(loaded[:, r * self.local_in:(r + 1) * self.local_in])
