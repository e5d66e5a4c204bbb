"""A tiny Llama whose greedy output is a script, for tests of output parsing (imported by
bare name).

Random models say random things, and the embedded model's words shift with the CPU's
arithmetic; a test of reasoning or tool-call parsing needs a model that writes given
text exactly. Here the next token depends on the last token only: every attention and
MLP weight is zero, so the residual stream stays the token's embedding, a one-hot row;
the final RMSNorm scales it to ``sqrt(hidden)``, and the LM head row of token ``j`` reads 1
at column ``i`` when ``j`` follows ``i`` in a script. The chosen token wins by
``sqrt(hidden)`` logits, on any CPU and dtype. Each token appears in at most one script
position, so one vocabulary holds several scripts and the chat template picks which
one runs by the token it ends the prompt with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN = 64
END = "<|end|>"
# Tokens that are never written by a script: the template's markers and a catch-all.
MARKERS = ["<unk>", END, "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

TOOL_CALL = '{"name": "get_capital", "arguments": {"country": "France"}}'

# start token -> the tokens the model writes after it (then END, or the script its last
# token starts). "▁" is a space.
SCRIPTS: dict[str, list[str]] = {
    # a Qwen3 / DeepSeek-R1 thinker: the prompt ends with the assistant marker, <think>
    # (DeepSeek-R1's templates) or <think></think> (Qwen3 with enable_thinking false)
    "<|assistant|>": ["<think>"],
    "<think>": ["I", "▁reckon", "▁so", ".", "</think>"],
    "</think>": ["Paris", "▁it", "▁is", "!"],
    # a thinker that calls a tool (Hermes' format), its tags split over two tokens each
    "<|assistant_tools|>": [
        "<th",
        "ink>",
        "Need",
        "▁a",
        "▁tool",
        "</thi",
        "nk>",
        "<tool_call>",
        TOOL_CALL,
        "</tool_call>",
    ],
    # Granite 3.2's thought and response markers
    "<|granite|>": ["Here▁is▁my▁thought▁process:", "▁Hmm,", "▁rivers.", "▁Here▁is▁my▁response:", "▁Rome."],
}

# Chat template: the last token of the generation prompt selects a script.
TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if tools -%}<|assistant_tools|>"
    "{%- elif thinking -%}<|granite|>"
    "{%- else -%}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>"
    "{%- elif think_in_prompt -%}<think>{%- endif -%}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _vocab() -> list[str]:
    out = list(MARKERS)
    for start, tokens in SCRIPTS.items():
        for t in [start, *tokens]:
            if t not in out:
                out.append(t)
    return out


def _successors(vocab: list[str]) -> dict[int, int]:
    index = {t: i for i, t in enumerate(vocab)}
    nxt: dict[int, int] = {}
    for start, tokens in SCRIPTS.items():
        chain = [start, *tokens] + ([] if tokens[-1] in SCRIPTS else [END])  # a script may run on into another
        for a, b in zip(chain, chain[1:]):
            assert nxt.get(index[a], index[b]) == index[b], f"{a!r} has two successors"
            nxt[index[a]] = index[b]
    return nxt


def scripted_model(folder: Path | str) -> Path:
    """Write the scripted Llama (float32 safetensors), its tokenizer and chat template."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    vocab = _vocab()
    v = len(vocab)
    assert v <= HIDDEN, "one-hot embeddings need hidden_size >= vocab_size"
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    # Every script token is matched whole in text, so prompts can hold them too; only the
    # end marker is special (skipped in output, as an EOS is).
    tok.add_tokens([AddedToken(t, normalized=False) for t in vocab if t not in (END, "<unk>")])
    tok.add_special_tokens([AddedToken(END, normalized=False, special=True)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=END, unk_token="<unk>", pad_token=END, model_max_length=2048
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(folder))
    cfg = transformers.LlamaConfig(
        vocab_size=v,
        hidden_size=HIDDEN,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=vocab.index(END),
        pad_token_id=vocab.index(END),
    )
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(v, HIDDEN))
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for i, j in _successors(vocab).items():
            model.lm_head.weight[j, i] = 1.0
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab.index(END)}))
    return folder
