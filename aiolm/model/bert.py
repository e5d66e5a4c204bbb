"""BERT-family encoders (BERT, XLM-RoBERTa) over a flat batch of whole sequences.

Absolute position and token-type embeddings, post-LayerNorm layers, bidirectional
attention within each request through the backend's ``forward_encoder`` (no KV cache:
every request's whole sequence is in the step and is done with after it). The linear
layers are the same tensor-parallel layers the decoders use, so a platform's packed
matmuls and a tensor-parallel split apply as they do there; embeddings of positions and
token types, the LayerNorms and the classifier head are replicated.

A sequence classifier (``BertForSequenceClassification``) adds the head that turns the
first token's final hidden state into label logits: BERT's pooler (dense + tanh) and its
classifier, or XLM-RoBERTa's classifier.dense + tanh + out_proj, the same arithmetic
under other names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from aiolm.attention.metadata import AttentionMetadata
from aiolm.checkpoint.bert import BertConfig
from aiolm.errors import ModelLoadError
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.embedding import VocabParallelEmbedding
from aiolm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from aiolm.model.layers.norm import LayerNorm


class Table(nn.Module):
    """A replicated embedding table (positions, token types)."""

    def __init__(self, rows: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, hidden), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BertConfig, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        tp = ctx.tp_group.world_size
        if cfg.num_heads % tp:
            raise ValueError(f"num_attention_heads {cfg.num_heads} not divisible by tensor parallel size {tp}")
        self.num_heads = cfg.num_heads // tp
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.qkv_proj = QKVParallelLinear(
            ctx,
            h,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_heads,
            bias=True,
            names=tuple(f"{prefix}.attention.self.{x}" for x in ("query", "key", "value")),
            output_to_kernel=True,  # no RoPE: q, k, v go straight to the attention
        )
        self.o_proj = RowParallelLinear(
            ctx, cfg.num_heads * cfg.head_dim, h, bias=True, names=(f"{prefix}.attention.output.dense",)
        )
        self.attn_norm = LayerNorm(h, cfg.layer_norm_eps, ctx.ops)
        self.up_proj = ColumnParallelLinear(
            ctx, h, [cfg.intermediate_size], bias=True, names=(f"{prefix}.intermediate.dense",)
        )
        self.down_proj = RowParallelLinear(ctx, cfg.intermediate_size, h, bias=True, names=(f"{prefix}.output.dense",))
        self.mlp_norm = LayerNorm(h, cfg.layer_norm_eps, ctx.ops)
        self.act = cfg.hidden_act  # a name of layers/activation.py, checked by checkpoint/bert.py
        self.attn = ctx.attention_backend(self.num_heads, self.num_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, size = x.shape[0], self.num_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([size, size, size], dim=-1)
        shape = (t, self.num_heads, self.head_dim)
        a = self.attn.forward_encoder(q.reshape(shape), k.reshape(shape), v.reshape(shape), meta)
        # a platform may hand a matmul's output over in a lower precision: the residual
        # stream stays in x's dtype
        h = self.attn_norm(self.o_proj(a), residual=x)
        return self.mlp_norm(self.down_proj(self.up_proj(h, activation=self.act)), residual=h)


class BertModel(nn.Module):
    """The encoder: final hidden states of every token."""

    is_encoder_only = True
    # checkpoint names (after the family's prefix) -> (our module, fused shard); per layer
    # names are under "encoder.layer.{i}." and ours under "layers.{i}."
    _LAYER_NAMES: ClassVar[dict[str, tuple[str, int]]] = {
        "attention.self.query": ("qkv_proj", 0),
        "attention.self.key": ("qkv_proj", 1),
        "attention.self.value": ("qkv_proj", 2),
        "attention.output.dense": ("o_proj", 0),
        "attention.output.LayerNorm": ("attn_norm", 0),
        "intermediate.dense": ("up_proj", 0),
        "output.dense": ("down_proj", 0),
        "output.LayerNorm": ("mlp_norm", 0),
    }
    _TOP_NAMES: ClassVar[dict[str, str]] = {
        "embeddings.word_embeddings": "embed_tokens",
        "embeddings.position_embeddings": "position_embeddings",
        "embeddings.token_type_embeddings": "token_type_embeddings",
        "embeddings.LayerNorm": "embed_norm",
    }
    # in a checkpoint, of no use to this model: position ids buffers, a language-model or
    # next-sentence head, and (on a plain encoder) the pooler
    _IGNORED: tuple[str, ...] = ("embeddings.position_ids", "cls.", "lm_head.", "pooler.")

    def __init__(self, cfg: BertConfig, ctx: BuildContext, max_positions: int | None = None) -> None:
        """``max_positions`` is ignored: the position table's rows are the checkpoint's."""
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, h)
        self.position_embeddings = Table(cfg.max_position_embeddings + cfg.position_offset, h)
        self.token_type_embeddings = Table(cfg.type_vocab_size, h)
        self.embed_norm = LayerNorm(h, cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg, ctx, f"encoder.layer.{i}") for i in range(cfg.num_layers))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch of whole sequences (positions
        0..n-1 each); ``kv_caches`` is not used (an encoder keeps none)."""
        x = self.embed_tokens(input_ids) + self.position_embeddings(positions + self.config.position_offset)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, meta)
        return x

    # -- loading --------------------------------------------------------------------------

    def _target(self, key: str) -> tuple[str, int] | None:
        """Our module path and shard for checkpoint name ``key`` (prefix removed, without
        .weight/.bias); None for a tensor the model does not use."""
        if key in self._TOP_NAMES:
            return self._TOP_NAMES[key], 0
        if key.startswith("encoder.layer."):
            idx, _, rest = key.removeprefix("encoder.layer.").partition(".")
            if rest in self._LAYER_NAMES and idx.isdigit() and int(idx) < self.config.num_layers:
                mod, shard = self._LAYER_NAMES[rest]
                return f"layers.{idx}.{mod}", shard
        return None

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must hold (prefix removed) and its shape."""
        c = self.config
        h, inter = c.hidden_size, c.intermediate_size
        want: dict[str, tuple[int, ...]] = {
            "embeddings.word_embeddings.weight": (c.vocab_size, h),
            "embeddings.position_embeddings.weight": (c.max_position_embeddings + c.position_offset, h),
            "embeddings.token_type_embeddings.weight": (c.type_vocab_size, h),
            "embeddings.LayerNorm.weight": (h,),
            "embeddings.LayerNorm.bias": (h,),
        }
        qkv = c.num_heads * c.head_dim
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}"
            for part in ("query", "key", "value"):
                want[f"{p}.attention.self.{part}.weight"] = (qkv, h)
                want[f"{p}.attention.self.{part}.bias"] = (qkv,)
            for name, out, inp in (
                ("attention.output.dense", h, qkv),
                ("intermediate.dense", inter, h),
                ("output.dense", h, inter),
            ):
                want[f"{p}.{name}.weight"] = (out, inp)
                want[f"{p}.{name}.bias"] = (out,)
            for name in ("attention.output.LayerNorm", "output.LayerNorm"):
                want[f"{p}.{name}.weight"] = (h,)
                want[f"{p}.{name}.bias"] = (h,)
        return want

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load Hugging Face-named tensors, with or without the family's prefix ("bert.":
        a classifier's checkpoint; none: a sentence-transformers folder). A tensor missing,
        misshapen or unknown is a ModelLoadError naming it."""
        modules = dict(self.named_modules())
        want = self._expected_shapes()
        prefix = f"{self.config.weight_prefix}."
        seen: set[str] = set()
        for name, tensor in weights:
            key = _modern(name.removeprefix(prefix))
            if key not in want:
                if key.startswith(self._IGNORED):
                    continue
                raise ModelLoadError(f"weight {name!r} does not belong to any {self.config.architecture} parameter")
            if tuple(tensor.shape) != want[key]:
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {want[key]}")
            self._load_one(modules, key, tensor)
            seen.add(key)
        missing = sorted(set(want) - seen)
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing {len(missing)} weights of {self.config.architecture} "
                f"(named here without {prefix!r}), e.g. {', '.join(missing[:3])}"
            )

    def _load_one(self, modules: dict[str, nn.Module], key: str, tensor: Any) -> None:
        base, _, pname = key.rpartition(".")
        target = self._target(base)
        assert target is not None, key  # every expected name has a target
        path, shard = target
        module = modules[path]
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear)):
            module.load_shard(pname, tensor, shard)
        else:
            getattr(module, pname).data.copy_(tensor[...])


def _modern(key: str) -> str:
    """A LayerNorm's parameters as PyTorch names them, in checkpoints from before it did."""
    base, _, leaf = key.rpartition(".")
    return f"{base}.{_OLD_NAMES[leaf]}" if leaf in _OLD_NAMES else key


_OLD_NAMES = {"gamma": "weight", "beta": "bias"}


class BertForSequenceClassification(BertModel):
    """The encoder plus its classifier head: ``classify`` of the first token's hidden state."""

    def __init__(self, cfg: BertConfig, ctx: BuildContext, max_positions: int | None = None) -> None:
        super().__init__(cfg, ctx, max_positions)
        h = cfg.hidden_size
        self.pooler = nn.Linear(h, h).requires_grad_(False)
        self.classifier = nn.Linear(h, cfg.num_labels).requires_grad_(False)

    def _head_names(self) -> dict[str, str]:
        """The head's checkpoint names (BERT's pooler and classifier, XLM-RoBERTa's
        classifier.dense and out_proj), without the family's prefix -> our module."""
        if self.config.roberta_head:
            return {"classifier.dense": "pooler", "classifier.out_proj": "classifier"}
        return {"pooler.dense": "pooler", "classifier": "classifier"}

    def _target(self, key: str) -> tuple[str, int] | None:
        head = self._head_names()
        return (head[key], 0) if key in head else super()._target(key)

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        want = super()._expected_shapes()
        h, n = self.config.hidden_size, self.config.num_labels
        pooler, classifier = self._head_names()
        want |= {f"{pooler}.weight": (h, h), f"{pooler}.bias": (h,)}
        want |= {f"{classifier}.weight": (n, h), f"{classifier}.bias": (n,)}
        return want

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Label logits [N, num_labels] in float32 of the first tokens' hidden states [N, hidden].
        Row by row: a GEMM's sums for one row depend on how many rows it has (torch takes
        another kernel for one), and a pair's score must not depend on the step it shared."""
        x = pooled.to(self.pooler.weight.dtype)
        return torch.cat([self.classifier(torch.tanh(self.pooler(row))) for row in x.split(1)]).float()
