"""Mixture-of-experts GGUF files for tests, laid out as llama.cpp's convert_hf_to_gguf.py writes them.

``write_moe_gguf`` takes a transformers Qwen3-MoE, Qwen2-MoE or Mixtral model and writes
what llama.cpp's converter would: architecture ``qwen3moe``, ``qwen2moe`` or ``llama`` (with
``llama.expert_count``), the ``{arch}.expert_*`` metadata, tensor names from gguf-py's own
name map, each layer's experts stacked into one ``ffn_{gate,up,down}_exps`` tensor per
projection ([experts, rows, cols] in numpy order), the router kept in F32 (llama.cpp never
quantizes it), and Mixtral's Q/K rows permuted as for any Llama. With ``qtype="Q8_0"`` the
matrices are Q8_0 and the shared expert's gate is written 1-D, as in quantized Qwen2-MoE
files; with ``"F32"`` everything is float32 and the shared expert's gate is its [1, hidden].

The tokenizer is a tiny byte-level BPE (``VOCAB`` tokens): gguf's reader and transformers'
GGUF tokenizer builder spend seconds on a real vocabulary, and the model's vocab_size must
equal the file's token count. ``tiny_moe_model`` builds a random model of that vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quantize as gguf_quantize

Q = gguf.GGMLQuantizationType
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "Ġ a", "o n", "r e", "Ġ s"]
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# transformers model_type -> (GGUF architecture, gguf-py's MODEL_ARCH for the name map)
GGUF_ARCH = {
    "qwen3_moe": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE),
    "qwen2_moe": ("qwen2moe", gguf.MODEL_ARCH.QWEN2MOE),
    "mixtral": ("llama", gguf.MODEL_ARCH.LLAMA),
}
# a sparse layer's expert projections, per family: the Hugging Face projection of each GGUF kind
_EXPERT_PROJ = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "qwen2_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}


def byte_level_vocab() -> tuple[list[str], list[int]]:
    """3 control tokens, the 256 byte symbols, then one token per merge (GPT-2's scheme)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list(bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in MERGES]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3)  # CONTROL, then NORMAL


VOCAB = len(byte_level_vocab()[0])


def tiny_moe_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A random float32 ``model_type`` model (qwen3_moe, qwen2_moe or mixtral) of ``VOCAB``
    tokens: hidden 64, 3 layers, 4 heads of 16 over 2 KV heads, top-2 routing; Qwen3-MoE with
    8 experts and layer 1 dense (mlp_only_layers), the others with 4. Widths are multiples of
    32 so every matrix can be Q8_0. Weights are drawn wider than the default init (std 0.15)
    so routing and greedy tokens depend on every part."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3_moe":
        cfg: Any = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            **{
                "num_experts": 8,
                "mlp_only_layers": [1],
                "decoder_sparse_step": 1,
                "norm_topk_prob": True,  # as in Qwen3's checkpoints (transformers' default is False)
                **overrides,
            },
        )
        cls: Any = transformers.Qwen3MoeForCausalLM
    elif model_type == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            norm_topk_prob=False,
            **overrides,
        )
        cls = transformers.Qwen2MoeForCausalLM
    elif model_type == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, **overrides)
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(f"model_type {model_type!r}; known: qwen3_moe, qwen2_moe, mixtral")
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def hub_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights under the names save_pretrained writes (one tensor per expert):
    transformers 5 keeps a layer's experts fused in memory and splits them on saving."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.detach().float().clone() for k, v in revert_weight_conversion(model, dict(model.state_dict())).items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for a Llama-architecture file (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w: gguf.GGUFWriter, cfg: Any, model_type: str) -> None:
    rope = getattr(cfg, "rope_parameters", None) or {}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_name(f"tiny {model_type}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if model_type == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    else:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if model_type == "qwen3_moe":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        else:
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    tokens, types = byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if model_type != "mixtral" else "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_moe_gguf(
    model: Any,
    path: Path,
    qtype: str = "F32",
    *,
    stacked: bool = True,
    edit: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
) -> None:
    """``model`` (Qwen3-MoE, Qwen2-MoE or Mixtral) written to ``path`` as llama.cpp's converter
    lays it out, its matrices F32, Q8_0 or Q5_0 (``qtype``); the model's vocab_size must be ``VOCAB``.

    ``stacked=False`` writes one tensor per expert (``blk.N.ffn_gate.E.weight``), as llama.cpp
    wrote Mixtral before it stacked them. ``edit(gguf_name, array)``, for files a converter
    must refuse, returns the array to write in its place (float32, before quantizing), or None
    to leave the tensor out."""
    cfg = model.config
    model_type = cfg.model_type
    if model_type not in GGUF_ARCH:
        raise ValueError(f"model_type {model_type!r}; known: {', '.join(GGUF_ARCH)}")
    if cfg.vocab_size != VOCAB:
        raise ValueError(f"vocab_size {cfg.vocab_size}: the file's tokenizer has {VOCAB} tokens")
    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
    file_types["Q5_0"] = gguf.LlamaFileType.MOSTLY_Q5_0
    if qtype not in file_types:
        raise ValueError(f"qtype {qtype!r}; known: {', '.join(file_types)}")
    arch, model_arch = GGUF_ARCH[model_type]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)  # llama.cpp's own mapping
    # llama.cpp's MoE architectures have no dense layer; one of Qwen3-MoE's mlp_only_layers is
    # written with a dense layer's names (ffn_gate, ffn_up, ffn_down), as in a Llama
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    state = hub_state_dict(model)
    experts = cfg.num_local_experts if model_type == "mixtral" else cfg.num_experts
    module, proj = _EXPERT_PROJ[model_type]

    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, cfg, model_type)
    w.add_file_type(file_types[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def add(hf: str, arr: np.ndarray, name: str | None = None) -> None:
        if name is None:
            base = hf.removesuffix(".weight").removesuffix(".bias")
            short = names.get_name(base) or dense_names.get_name(base)
            if short is None:
                raise KeyError(f"gguf-py has no {arch} name for {hf}")
            name = short + hf[len(base) :]
        if edit is not None:
            edited = edit(name, arr)
            if edited is None:
                return
            arr = edited
        keep_f32 = arr.ndim == 1 or name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        if name.endswith("ffn_gate_inp_shexp.weight") and qtype != "F32":
            arr = arr.reshape(-1)  # 1-D in quantized files (transformers' GGUF loader says so too)
        if qtype == "F32" or keep_f32:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
        else:
            t = Q[qtype]
            w.add_tensor(name, gguf_quantize(np.ascontiguousarray(arr, np.float32), t), raw_dtype=t)

    for hf, t in state.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output tensor
        if ".experts." in hf and module in hf:
            continue  # stacked below, per layer and projection
        arr = t.numpy()
        if model_type == "mixtral" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads)
        add(hf, arr)
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.{module}.experts."
        if f"{prefix}0.{proj['gate']}.weight" not in state:
            continue  # a dense layer
        for kind in ("gate", "up", "down"):
            each = [state[f"{prefix}{e}.{proj[kind]}.weight"].numpy() for e in range(experts)]
            if stacked:  # gguf-py maps the stacked name to ffn_*_exps
                add(f"{prefix}{proj[kind]}.weight", np.stack(each))
            else:
                for e, arr in enumerate(each):
                    add(f"{prefix}{e}.{proj[kind]}.weight", arr, name=f"blk.{i}.ffn_{kind}.{e}.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
