"""Gemma 3 (text) decoder over a flat token batch: ``Gemma3ForCausalLM`` checkpoints.

What sets it apart from the Llama family (llama.py), each as transformers computes it:

- layers alternate between a sliding window and global attention (``layer_types``,
  or older configs' ``sliding_window_pattern``: every n-th layer global), and each
  kind has its own RoPE: ``rope_local_base_freq`` for the local layers, the global
  theta (and ``rope_scaling``, if any) for the global ones;
- queries are scaled by ``query_pre_attn_scalar ** -0.5``, after a per-head RMSNorm
  of q and k;
- every norm multiplies by ``1 + weight``: the loader adds the 1 once, so the norms
  are the plain RMSNorm layers Llama uses (float32 math, same bits);
- four norms per layer: input and post-attention around attention, pre- and
  post-feedforward around the MLP, each branch added to the residual after its
  post-norm;
- the MLP is GeGLU (tanh-approximated GELU of the gate, times up);
- embeddings are scaled by sqrt(hidden_size); the final logits are tanh soft-capped
  when ``final_logit_softcapping`` is set.

Weights keep Hugging Face's names; q/k/v and gate/up are fused as in llama.py, whose
loading this module reuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from aiolm.attention.image_spans import attend_within_spans
from aiolm.attention.metadata import AttentionMetadata
from aiolm.checkpoint.gemma3 import Gemma3Config
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aiolm.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from aiolm.model.layers.norm import RMSNorm
from aiolm.model.layers.rotary import RotaryEmbedding
from aiolm.model.llama import LlamaForCausalLM

_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # transformers' name -> F.gelu's approximate


class Gemma3Attention(nn.Module):
    def __init__(
        self, cfg: Gemma3Config, ctx: BuildContext, rotary: RotaryEmbedding, window: int | None, prefix: str = ""
    ) -> None:
        super().__init__()
        tp = ctx.tp_group.world_size
        if cfg.num_heads % tp:
            raise ValueError(f"num_attention_heads {cfg.num_heads} not divisible by tensor parallel size {tp}")
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp)
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            ctx,
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.attention_bias,
            names=tuple(f"{prefix}.{x}_proj" for x in "qkv"),
        )
        self.o_proj = RowParallelLinear(
            ctx, cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, names=(f"{prefix}.o_proj",)
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx.ops)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx.ops)
        self.rotary = rotary
        self.attn = ctx.attention_backend(
            self.num_heads, self.num_kv_heads, self.head_dim, cfg.query_pre_attn_scalar**-0.5, sliding_window=window
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, meta)
        if meta.image_spans:  # an image's tokens see the whole image (a vision model's prompt)
            attend_within_spans(out, q, kv_cache, meta, self.attn)
        return self.o_proj(out)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3Config, ctx: BuildContext, prefix: str = "") -> None:
        super().__init__()
        self.ops = ctx.ops
        self.gate_up_proj = ColumnParallelLinear(
            ctx, cfg.hidden_size, [cfg.intermediate_size] * 2, names=(f"{prefix}.gate_proj", f"{prefix}.up_proj")
        )
        self.down_proj = RowParallelLinear(ctx, cfg.intermediate_size, cfg.hidden_size, names=(f"{prefix}.down_proj",))
        self.approximate = _ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_and_mul(self.gate_up_proj(x), self.approximate))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, cfg: Gemma3Config, ctx: BuildContext, rotary: RotaryEmbedding, window: int | None, prefix: str = ""
    ) -> None:
        super().__init__()
        h, eps, ops = cfg.hidden_size, cfg.rms_norm_eps, ctx.ops
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.self_attn = Gemma3Attention(cfg, ctx, rotary, window, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, ops)
        self.mlp = Gemma3MLP(cfg, ctx, prefix=f"{prefix}.mlp")
        self.post_feedforward_layernorm = RMSNorm(h, eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's post-feedforward output; residual: the stream before it
        (None at layer 0). Returns this layer's output and the stream it is to be added to."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)  # residual += attention branch
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: Gemma3Config, ctx: BuildContext, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        length = max_positions or cfg.max_position_embeddings
        global_rope = RotaryEmbedding(cfg.head_dim, length, cfg.rope_theta, cfg.rope_scaling, ctx.ops)
        local_rope = RotaryEmbedding(cfg.head_dim, length, cfg.rope_local_theta, None, ctx.ops)
        self.embed_tokens = VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                cfg, ctx, local_rope if cfg.local_layers[i] else global_rope, cfg.window(i), prefix=f"model.layers.{i}"
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops)
        self.lm_head = ParallelLMHead(
            ctx, cfg.vocab_size, cfg.hidden_size, tied_to=self.embed_tokens if cfg.tie_word_embeddings else None
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens from many sequences;
        ``mm_embeds`` (rows, embeddings): image embeddings that replace those rows' scaled
        token embeddings (model/gemma3_vision.py)."""
        x = self.embed_tokens(input_ids)
        # as transformers scales: sqrt(hidden) in float32, then rounded to the activations' dtype
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(x.dtype)
        if mm_embeds is not None:
            x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, cache, meta)
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors, fused and checked as llama.py does, with each norm's
        weight w stored as 1 + w: Gemma's norms multiply by 1 + w, which transformers forms
        in float32 on every call, so a float32 model gets the same product."""
        LlamaForCausalLM.load_weights(self, _offset_norms(weights))  # type: ignore[arg-type]

    def holds(self, key: str) -> bool:
        """Called by load_weights: Gemma 3 runs as one pipeline stage, so every tensor is its."""
        return True

    def _check_complete(self, seen: set[str]) -> None:
        """Called by load_weights: every parameter arrived (lm_head only when untied)."""
        expected = {f"{name}#0" for name, _ in self.named_parameters() if not name.startswith("lm_head")}
        for i in range(self.config.num_layers):  # fused layers: one entry per Hugging Face shard
            p = f"layers.{i}"
            expected -= {f"{p}.self_attn.qkv_proj.weight#0", f"{p}.mlp.gate_up_proj.weight#0"}
            expected |= {f"{p}.self_attn.qkv_proj.weight#{s}" for s in range(3)}
            expected |= {f"{p}.mlp.gate_up_proj.weight#{s}" for s in range(2)}
            if self.config.attention_bias:
                expected -= {f"{p}.self_attn.qkv_proj.bias#0"}
                expected |= {f"{p}.self_attn.qkv_proj.bias#{s}" for s in range(3)}
        if not self.config.tie_word_embeddings:
            expected.add("lm_head.weight#0")
        missing = sorted(expected - seen)
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")


def _offset_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor[...].float() + 1.0  # a norm weight is small: read it whole (LazyWeight or tensor)
        yield name, tensor
