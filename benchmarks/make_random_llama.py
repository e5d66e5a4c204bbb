"""Write a random-weight Llama folder with the embedded model's tokenizer, for benchmarks
that need a model of a given size and shape (e.g. tensor parallelism at a few hundred MB).

    python benchmarks/make_random_llama.py /tmp/llama-470m --hidden 1024 --intermediate 2816 \\
        --layers 6 --heads 16 --kv-heads 4

No weights are downloaded; the tokenizer and chat template come from the embedded
SmolLM2 (converted once into aiolm's cache), so prompts and chats work as usual.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from aiolm.checkpoint.source import resolve_model

    src = resolve_model(None)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=src.config.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src.path / name).exists():
            shutil.copy(src.path / name, args.out / name)
    n = sum(t.numel() for t in model.parameters())
    print(f"{args.out}: {n / 1e6:.0f}M parameters, {n * 4 / 2**20:.0f} MiB float32")


if __name__ == "__main__":
    main()
