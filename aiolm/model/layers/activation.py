"""Activations by the names transformers' configs give them (``hidden_act``), for the
layers that apply them in plain torch (encoders, vision towers, projectors); a family's
config reader checks the name first (checkpoint/bert.py, checkpoint/vision.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
}
