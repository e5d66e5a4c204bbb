"""A ModelSource's weights as torch tensors: the worker's side of loading.

What a model's files say (config, tokenizer, chat template, where the weights are, the
GGUF conversion cache) is read without torch in aiolm/checkpoint/; this module streams
the safetensors it names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from aiolm.checkpoint.source import ModelSource
from aiolm.errors import ModelLoadError


def iter_weights(
    source: ModelSource, lazy: bool = False, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield (hf_name, tensor) lazily, one file open at a time.

    ``lazy``: yield a ``LazyWeight`` instead, which reads only the part it is indexed
    with, so a tensor-parallel rank copies only its own slice of each tensor. It is
    valid until the next item is taken. ``keep``: only the names it accepts, the others
    never read (a pipeline stage's share of the checkpoint).
    """
    quant = source.config.quantization
    if quant is not None:
        from aiolm.quant.checkpoint_formats import dequantized_weights

        yield from dequantized_weights(_iter_files(source, lazy, keep), quant)
    else:
        yield from _iter_files(source, lazy, keep)


def _iter_files(source: ModelSource, lazy: bool, keep: Callable[[str], bool] | None) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for f in source.safetensors_files():
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors' own error type: a file cut short, empty or not safetensors
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
        with handle as st:
            for name in st.keys():  # noqa: SIM118 (a safetensors file handle, not a dict)
                if keep is not None and not keep(name):
                    continue
                yield name, LazyWeight(st.get_slice(name)) if lazy else st.get_tensor(name)


class LazyWeight:
    """A tensor still in its safetensors file: ``shape``, ``dtype`` (safetensors' name of it:
    F32, BF16, F8_E4M3, ...), and ``w[index]`` reads only that part (``w[...]`` all of it).
    ``bytes_read`` counts what indexing has read so far."""

    def __init__(self, part: Any) -> None:
        import torch

        self._part = part
        self.shape = torch.Size(part.get_shape())
        self.dtype: str = part.get_dtype()
        self.bytes_read = 0

    def __getitem__(self, index: Any) -> Any:
        t = self._part[index]
        self.bytes_read += t.numel() * t.element_size()
        return t
