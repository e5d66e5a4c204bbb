"""Vocabulary-parallel embedding and LM head: each rank owns a slice of the vocabulary."""

from __future__ import annotations

import torch
from torch import nn

from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.linear import LinearBase
from aiolm.model.layers.weights import copy_weight
from aiolm.quant.base import LinearSpec


class VocabParallelEmbedding(nn.Module):
    def __init__(self, ctx: BuildContext, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp = ctx.tp_group
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + self.tp.world_size - 1) // self.tp.world_size
        self.start = self.tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        if not isinstance(self, LinearBase):  # an LM head's weight is its quant method's
            self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return nn.functional.embedding(ids, self.weight)
        mask = (ids >= self.start) & (ids < self.end)
        local = torch.where(mask, ids - self.start, torch.zeros_like(ids))
        y = nn.functional.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(y)

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        hidden = self.weight.shape[1]
        if tuple(loaded.shape) != (self.vocab_size, hidden):  # rows past vocab_size were never read
            raise ValueError(
                f"expected shape {(self.vocab_size, hidden)} (vocab_size, hidden), got {tuple(loaded.shape)}"
            )
        part = loaded[self.start : self.end]
        copy_weight(self.weight.data[: part.shape[0]], part, name)


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Logits for this rank's vocabulary slice; gathered to full vocabulary on return.

    ``tied_to``: the embedding whose weight the head reads (tie_word_embeddings); its
    quant method then keeps that weight as it is and lays out a copy, if any."""

    def __init__(
        self, ctx: BuildContext, vocab_size: int, hidden: int, tied_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__(ctx, vocab_size, hidden)
        spec = LinearSpec(
            ("model.embed_tokens",) if tied_to is not None else ("lm_head",),
            lm_head=True,
            shared_weight=tied_to is not None,
        )
        self._take_method(ctx, spec, hidden, [self.per_rank])
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight.data.zero_()  # rows past the vocabulary (the last rank's slice) stay zero

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self._matmul(hidden)
        if self.tp.world_size > 1:
            out = self.tp.all_gather(out)
        return out[:, : self.vocab_size]
