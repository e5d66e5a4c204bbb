"""Prompts with images -> token ids and ImageInputs, through the model folder's own
processor from transformers, so resizing, normalisation and the expansion of each image
into its placeholder tokens are the reference's.

Runs in the engine process, off the event loop (a thread): decoding, resizing and
hashing cost milliseconds per image. Images arrive decoded (multimodal/media.py fetched
them within the server's limits); the processor returns numpy arrays, never tensors.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any

import numpy as np

from aiolm.multimodal.inputs import ImageInput
from aiolm.params import ParamError


class ImagePrompts:
    """The processor of one vision-language model folder."""

    def __init__(
        self, model_path: Path, image_token_id: int, tokens_per_image: int, max_images: int, max_pixels: int
    ) -> None:
        self.model_path = model_path
        self.max_pixels = max_pixels  # --max-image-pixels: of the image as the processor resizes it too
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.max_images = max_images  # --limit-mm-per-prompt image=N
        self._processor: Any = None
        self._lock = threading.Lock()

    def processor(self) -> Any:
        """transformers' processor of the folder, loaded once (on first use, in a thread)."""
        with self._lock:
            if self._processor is None:
                from transformers import AutoProcessor

                self._processor = AutoProcessor.from_pretrained(str(self.model_path))
            return self._processor

    def check_count(self, n: int, field: str) -> None:
        if n > self.max_images:
            raise ParamError(
                field, f"{n} images in one prompt; this server takes at most {self.max_images} (--limit-mm-per-prompt)"
            )

    async def encode(
        self, text: str, images: list[Any], special: bool, names: list[str]
    ) -> tuple[list[int], list[ImageInput]]:
        """Token ids of ``text`` with each image marker expanded, and the images' inputs;
        ``names`` says where each image was in the request (for errors)."""
        return await asyncio.to_thread(self._encode, text, images, special, names)

    def _encode(
        self, text: str, images: list[Any], special: bool, names: list[str]
    ) -> tuple[list[int], list[ImageInput]]:
        proc = self.processor()
        for image, name in zip(images, names, strict=True):
            self._check_resized(proc, image, name)
        try:
            out = proc(text=[text], images=images or None, return_tensors="np", add_special_tokens=special)
        except ValueError as e:  # the text's image markers and the images do not match
            raise ParamError("messages", f"the prompt and its images do not fit together: {e}") from e
        ids = [int(t) for t in out["input_ids"][0]]
        offsets = self._placeholders(ids)
        if len(offsets) != len(images):
            raise ParamError(
                "messages",
                f"the prompt has placeholders for {len(offsets)} images but {len(images)} images came with it",
            )
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32) if images else None
        inputs = []
        for i, offset in enumerate(offsets):
            assert pixels is not None
            data = pixels[i].tobytes()
            shape = list(pixels[i].shape)
            digest = hashlib.sha256(repr(shape).encode() + data).hexdigest()
            inputs.append(ImageInput(digest, offset, self.tokens_per_image, data, shape))
        return ids, inputs

    def _check_resized(self, proc: Any, image: Any, name: str) -> None:
        """A processor that resizes the shortest edge to S makes a 1 x N image S x S*N: a few
        bytes could ask for gigabytes. Its size after resizing must be within max_pixels."""
        size = getattr(getattr(proc, "image_processor", None), "size", None)
        # a dict in older transformers, a SizeDict (attributes) in newer ones
        edge = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
        if not edge:
            return  # resized to a fixed size (or left alone: then the header check bounded it)
        w, h = image.size
        resized = edge * edge * max(w, h) / max(1, min(w, h))
        if resized > self.max_pixels:
            raise ParamError(
                name,
                f"an image of {w}x{h} pixels would be {int(resized)} pixels once this model's processor "
                f"resizes its shortest side to {edge}, more than the server's limit of {self.max_pixels} "
                "(--max-image-pixels)",
            )

    def check_placeholders(self, ids: list[int], images: list[ImageInput], field: str) -> None:
        """ParamError unless the prompt's image tokens are exactly its images' placeholders:
        an image token with no image would run as a text embedding the model never saw."""
        covered = sum(im.length for im in images)
        found = sum(1 for t in ids if t == self.image_token_id)
        inside = all(
            0 <= im.offset
            and im.offset + im.length <= len(ids)
            and all(t == self.image_token_id for t in ids[im.offset : im.offset + im.length])
            for im in images
        )
        if found != covered or not inside:
            raise ParamError(
                field,
                f"the prompt has {found} image tokens but its {len(images)} images fill {covered}: "
                "image tokens may only stand for images sent with the prompt",
            )

    def _placeholders(self, ids: list[int]) -> list[int]:
        """The offset of each image's run of placeholder tokens (runs of images side by side
        split every tokens_per_image tokens)."""
        offsets: list[int] = []
        i, n, want = 0, len(ids), self.tokens_per_image
        while i < n:
            if ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < n and ids[j] == self.image_token_id:
                j += 1
            if (j - i) % want:
                raise ParamError(
                    "prompt", f"a run of {j - i} image tokens is not a whole number of images of {want} tokens"
                )
            offsets += range(i, j, want)
            i = j
        return offsets
