"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat token batch.

One implementation; the per-architecture differences are flags on ModelConfig:
QKV bias (Qwen2), per-head QK RMSNorm (Qwen3), tied embeddings, RoPE scaling,
sliding windows (Mistral; Qwen2 / Qwen3 where the config enables them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from aiolm.attention.metadata import AttentionMetadata
from aiolm.checkpoint.config import ModelConfig
from aiolm.errors import ModelLoadError
from aiolm.model.layers.context import BuildContext
from aiolm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from aiolm.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from aiolm.model.layers.norm import RMSNorm
from aiolm.model.layers.rotary import RotaryEmbedding
from aiolm.model.layers.weights import copy_weight


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ctx: BuildContext, rotary: RotaryEmbedding, window: int | None = None, prefix: str = ""
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
        self.o_proj = RowParallelLinear(ctx, cfg.num_heads * cfg.head_dim, cfg.hidden_size, names=(f"{prefix}.o_proj",))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx.ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx.ops) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = ctx.attention_backend(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, sliding_window=window
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn.forward(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext, prefix: str = "", intermediate: int | None = None) -> None:
        super().__init__()
        self.ops = ctx.ops
        inter = intermediate or cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            ctx, cfg.hidden_size, [inter] * 2, names=(f"{prefix}.gate_proj", f"{prefix}.up_proj")
        )
        self.down_proj = RowParallelLinear(ctx, inter, cfg.hidden_size, names=(f"{prefix}.down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class MissingLayer(nn.Module):
    """The place of a decoder layer that another pipeline stage runs: no weights, no KV."""


class DecoderLayer(nn.Module):
    # A whole-layer step for the steps it can take, which the quant config the layer was
    # built with may offer once the layer's weights are ready (a GGUF file's blocks:
    # aiolm/quant/gguf_blocks.py); it answers None for the others, which run the modules.
    fused: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: BuildContext,
        rotary: RotaryEmbedding,
        window: int | None = None,
        prefix: str = "",
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the feed-forward block, when not the dense MLP (a layer of experts)."""
        super().__init__()
        self.quant = ctx.quant
        self.lora = ctx.lora  # a step with adapter rows runs the modules, which add them
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops)
        self.self_attn = Attention(cfg, ctx, rotary, window, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops)
        self.mlp = mlp if mlp is not None else MLP(cfg, ctx, prefix=f"{prefix}.mlp")

    def process_weights_after_loading(self) -> None:
        """After its parts' own steps (model/layers/context.py): take the fused step, if offered."""
        self.fused = self.quant.fused_decoder_layer(self)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output; residual: the stream before it (None at layer 0).
        Returns this layer's output and the stream it is to be added to."""
        if self.fused is not None and (self.lora is None or not self.lora.active):
            done = self.fused(positions, x, residual, kv_cache, meta)
            if done is not None:
                return done
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# Hugging Face parameter suffix -> (our fused module suffix, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, ctx.ops
        )
        # One pipeline stage (ctx.stage) builds only its layers; the others' places hold
        # MissingLayer, so names and indexes stay the checkpoint's. The first stage embeds,
        # the last normalises and computes logits (and keeps the embeddings if they are tied).
        stage = self.stage = ctx.stage
        self.local_layers = stage.layers(cfg.num_layers)
        tied_head = stage.is_last and cfg.tie_word_embeddings and not ctx.pooling
        self.embed_tokens = (
            VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.hidden_size) if stage.is_first or tied_head else None
        )
        self.activation_dtype = ctx.dtype
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                ctx,
                rotary,
                cfg.window(i),
                f"model.layers.{i}",
                self.make_mlp(cfg, ctx, i, f"model.layers.{i}.mlp"),
            )
            if i in self.local_layers
            else MissingLayer()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.ops) if stage.is_last else None
        # a model built to pool (an embedder) has no LM head, and its checkpoint (a
        # sentence-transformers folder: the bare decoder) need not hold one
        self.lm_head = (
            None
            if ctx.pooling or not stage.is_last
            else ParallelLMHead(
                ctx, cfg.vocab_size, cfg.hidden_size, tied_to=self.embed_tokens if cfg.tie_word_embeddings else None
            )
        )
        self.quant, self.lora = ctx.quant, ctx.lora
        # the stage's layers as one step, where the quant method offers it; and with the
        # model's end (final norm, LM head, sampling) too, for decode steps
        self.fused_stack: Callable[..., Any] | None = None
        self.sample_step: Callable[..., Any] | None = None

    def process_weights_after_loading(self) -> None:
        """After every layer's own step: the stage's fused steps as one call, if offered."""
        steps = [getattr(self.layers[i], "fused", None) for i in self.local_layers]
        self.fused_stack = self.quant.fused_decoder_stack(steps) if all(f is not None for f in steps) else None
        plain_end = (
            type(self).forward is LlamaForCausalLM.forward
            and type(self).compute_logits is LlamaForCausalLM.compute_logits
        )
        whole = self.embed_tokens is not None and self.lm_head is not None  # one stage: the tokens to the logits
        self.sample_step = (
            self.quant.fused_sample_step(self.fused_stack, self.norm, self.lm_head)
            if self.fused_stack is not None and plain_end and whole
            else None
        )

    @torch.inference_mode()
    def sampled_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        sampling: Any = None,
    ) -> torch.Tensor | None:
        """For a decode step (one token a request): each row's token as forward,
        compute_logits and the sampler would give it (the argmax where ``sampling`` is None;
        else the sampler's draw with that SamplingMetadata, which has no processors or
        logprobs), from one call where the quant method offers it (its layers, final norm, LM
        head and sampling); None where it does not take the step."""
        step = self.sample_step
        if step is None or (self.lora is not None and self.lora.active):
            return None
        return step(positions, input_ids, self.embed_tokens, kv_caches, meta, sampling)

    def make_mlp(self, cfg: ModelConfig, ctx: BuildContext, layer: int, prefix: str) -> nn.Module | None:
        """Layer ``layer``'s feed-forward block where it is not the dense MLP; None here."""
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens from many sequences;
        ``mm_embeds`` (rows, embeddings): image embeddings that replace those rows' token
        embeddings (the placeholders of a vision-language prompt, model/llava.py);
        ``intermediate``: on a later pipeline stage, what the stage before it handed on."""
        x, residual = self.run_layers(input_ids, positions, kv_caches, meta, mm_embeds, intermediate)
        assert self.norm is not None, "only the last pipeline stage ends the model"
        if residual is None:
            return self.norm(x)
        return self.norm(x.to(residual.dtype), residual)[0]  # float32 into the LM head

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers (``kv_caches``: theirs, in order): from the token embeddings on
        the first stage, else from ``intermediate``; returns the last layer's output and the
        residual stream, which a stage before the last hands on as they are."""
        if intermediate is None:
            assert self.embed_tokens is not None, "a later pipeline stage starts from the previous one's output"
            x = self.embed_tokens(input_ids)
            if mm_embeds is not None:
                x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
            residual = None
        else:
            x, residual = intermediate
        stack = self.fused_stack
        if stack is not None and (self.lora is None or not self.lora.active):
            done = stack(positions, x, residual, kv_caches, meta)
            if done is not None:
                return done
        layers = self.layers
        for i, cache in zip(self.local_layers, kv_caches):
            x, residual = layers[i](positions, x, residual, cache, meta)
        return x, residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError(f"this {self.config.architecture} model was built for pooling: it has no LM head")
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and (self.config.tie_word_embeddings or self.lm_head is None):
                continue
            key = name.removeprefix("model.")
            if key.startswith("layers.") and not int(key.split(".", 2)[1]) < self.config.num_layers:
                raise KeyError(f"weight {name!r} is of a layer past the config's {self.config.num_layers}")
            if not self.holds(key):
                continue  # another pipeline stage's
            mod_path, _, pname = key.rpartition(".")
            parent, _, leaf = mod_path.rpartition(".")
            shard = 0
            if leaf in _FUSED:
                fused, shard = _FUSED[leaf]
                mod_path = f"{parent}.{fused}"
            if key.startswith("lm_head"):
                mod_path = "lm_head"
            module = modules.get(mod_path)
            if module is None:
                raise KeyError(f"weight {name!r} does not belong to any {self.config.architecture} parameter")
            try:
                if hasattr(module, "load_shard"):
                    module.load_shard(pname, tensor, shard)
                else:
                    copy_weight(getattr(module, pname).data, tensor[...], pname)
            except ValueError as e:  # the checkpoint's name, not the fused layer's
                raise ModelLoadError(f"weight {name!r}: {e}") from None
            seen.add(f"{mod_path}.{pname}#{shard}")
        self._check_complete(seen)

    def _check_complete(self, seen: set[str]) -> None:
        expected = {"embed_tokens.weight#0"} if self.embed_tokens is not None else set()
        if self.norm is not None:
            expected.add("norm.weight#0")
        if not self.config.tie_word_embeddings and self.lm_head is not None:
            expected.add("lm_head.weight#0")
        for i in self.local_layers:
            p = f"layers.{i}"
            expected |= {f"{p}.self_attn.qkv_proj.weight#{s}" for s in range(3)}
            expected |= self.expected_mlp_weights(i, f"{p}.mlp")
            expected |= {
                f"{p}.self_attn.o_proj.weight#0",
                f"{p}.input_layernorm.weight#0",
                f"{p}.post_attention_layernorm.weight#0",
            }
        missing = sorted(expected - seen)
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")

    def holds(self, key: str) -> bool:
        """Whether this pipeline stage loads the tensor ``key`` (its name less ``model.``)."""
        if key.startswith("layers."):
            return int(key.split(".", 2)[1]) in self.local_layers
        if key.startswith("embed_tokens."):
            return self.embed_tokens is not None
        if key.startswith("norm."):
            return self.norm is not None
        if key.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def expected_mlp_weights(self, layer: int, prefix: str) -> set[str]:
        """What ``load_weights`` must have filled of layer ``layer``'s feed-forward block."""
        return {f"{prefix}.gate_up_proj.weight#0", f"{prefix}.gate_up_proj.weight#1", f"{prefix}.down_proj.weight#0"}
