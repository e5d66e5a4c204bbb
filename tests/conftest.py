"""Session fixtures shared by the suite: the real embedded model and its reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def real_source():
    from aiolm.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(real_source):
    return real_source.load_tokenizer()


@pytest.fixture(scope="session")
def real_model(real_source):
    from aiolm.model.registry import build_model

    return build_model(real_source, torch.float32)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own model read from the same GGUF file, float32."""
    from transformers import AutoModelForCausalLM

    from aiolm.model.loader import embedded_model_path

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """A plain greedy loop with an explicit all-ones mask (pad id == eos id in SmolLM2)."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new):
            res = model(ids if past is None else ids[:, -1:], attention_mask=torch.ones_like(ids),
                        past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
