"""An image as it crosses from the engine to the workers: where its placeholder tokens
sit in the prompt, its processed pixels, and the hash that names it.

Torch-free (a msgspec struct of ints, strings and bytes): the engine process builds it
from the model folder's processor (multimodal/processor.py), the scheduler reads its
offset, length and hash, and the workers turn its pixels into the encoder's input.
"""

from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One image of a prompt. ``hash`` (sha256 of the processed pixels and their shape) keys
    the encoder cache and goes into the block hashes of the blocks its placeholders fill, so
    the same text with another image never shares KV."""

    hash: str
    offset: int  # index in the prompt of its first placeholder token
    length: int  # placeholder tokens: the embeddings the encoder gives for it
    pixels: bytes  # float32 pixel values, C order
    shape: list[int]  # [channels, height, width]

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) hold any of its placeholders."""
        return self.offset < end and start < self.offset + self.length
