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

# One thread: test processes share two cores with worker processes, and OpenMP
# spin-waiting makes oversubscribed torch threads many times slower.
torch.set_num_threads(1)


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


from paged import hf_greedy  # noqa: E402,F401  (re-exported for older imports)
