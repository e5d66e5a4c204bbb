"""Test helper: tiny random vision-language models (Llava on Llama or Qwen2, Gemma 3) saved as
folders that transformers' own ``AutoProcessor`` and ``AutoModelForImageTextToText`` load, random
PNG images, and transformers' greedy tokens as the reference.

The tokenizer is the embedded SmolLM2 one (vocabulary 49152) with the family's image tokens
added after it, so the text vocabulary is 49152 + the number of added tokens. Nothing is
downloaded."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

import torch

# Parts of an OpenAI-style message's content that the chat templates render as an image.
IMAGE_PARTS = ("image", "image_url")

# ChatML, as SmolLM2's own template, with content either a string or a list of parts; IMAGE is
# replaced by the family's image placeholder, which the processor expands, and IMAGE_PARTS by
# the tuple above.
_TEMPLATE = r"""{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' -}}
{%- if message['content'] is string -%}
{{- message['content'] -}}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}
{{- part['text'] -}}
{%- elif part['type'] in IMAGE_PARTS -%}
{{- 'IMAGE' -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}"""

# SmolLM2's <|im_start|> and <|im_end|> (0 is <|endoftext|>)
_BOS, _EOS = 1, 2

# Loaded (processor, model) per folder, so a test module pays the load once.
_LOADED: dict[str, tuple[Any, Any]] = {}


def chat_template(image: str) -> str:
    """The ChatML chat template with ``image`` at each image part of a message's content."""
    return _TEMPLATE.replace("'IMAGE'", repr(image)).replace("IMAGE_PARTS", repr(IMAGE_PARTS))


def _tokenizer(tokenizer_from: Path, tokens: dict[str, str]) -> Any:
    """The tokenizer of ``tokenizer_from`` with ``tokens`` (attribute name -> token) added as
    special tokens after its vocabulary, readable as ``tok.<name>`` and ``tok.<name>_id``."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tokenizer_from, extra_special_tokens=tokens)


def _randomize(model: torch.nn.Module) -> None:
    """Matrices (and conv kernels) normal(0, 0.2): large enough that greedy tokens wander and
    that different images lead to different tokens."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)


def tiny_llava(
    path: Path,
    tokenizer_from: Path,
    text: str = "llama",
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    strategy: str = "default",
) -> Path:
    """A float32 random ``LlavaForConditionalGeneration`` (CLIP vision tower, ``text`` = llama or
    qwen2 language model) with its ``LlavaProcessor`` saved to ``path``. One ``<image>`` in the
    text becomes (image_size / patch_size)^2 image tokens, plus one (the CLS) with
    ``strategy="full"``."""
    import transformers

    tok = _tokenizer(tokenizer_from, {"image_token": "<image>"})
    image_id = tok.image_token_id
    patches = (image_size // patch_size) ** 2
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=_BOS,
        eos_token_id=_EOS,
        pad_token_id=_EOS,
    )
    if text == "llama":
        text_config = transformers.LlamaConfig(**common)
    elif text == "qwen2":
        text_config = transformers.Qwen2Config(**common)
    else:
        raise ValueError(text)
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_index=image_id,
        image_seq_length=patches + (strategy == "full"),
        projector_hidden_act="gelu",
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)

    image_processor = transformers.CLIPImageProcessorPil(
        do_resize=True,
        size={"shortest_edge": image_size},
        do_center_crop=True,
        crop_size={"height": image_size, "width": image_size},
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,  # CLIP's CLS
        chat_template=chat_template("<image>"),
    )
    tok.chat_template = processor.chat_template
    processor.save_pretrained(path)
    return path


def tiny_gemma3_vision(path: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A float32 random ``Gemma3ForConditionalGeneration`` (SigLIP vision tower, 16 patches
    pooled to 4 image tokens, one sliding and one full attention layer) with its
    ``Gemma3Processor`` saved to ``path``. One ``<start_of_image>`` in the text becomes
    "\\n\\n" <start_of_image> 4 x <image_soft_token> <end_of_image> "\\n\\n".

    Real Gemma 3 ties the output head to the embeddings; here the head is its own matrix,
    because random tied weights keep choosing the token just seen, whatever the image."""
    import transformers

    tok = _tokenizer(
        tokenizer_from,
        {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        vision_use_head=False,
    )
    text_config = transformers.Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=_BOS,
        eos_token_id=_EOS,
        pad_token_id=_EOS,
        tie_word_embeddings=False,
    )
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text_config,
        mm_tokens_per_image=4,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    _randomize(model)
    model.save_pretrained(path)

    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=chat_template("<start_of_image>"),
        image_seq_length=config.mm_tokens_per_image,
    )
    tok.chat_template = processor.chat_template
    processor.save_pretrained(path)
    return path


def png_image(seed: int, width: int = 40, height: int = 30) -> bytes:
    """A random-noise RGB PNG: different seeds give clearly different images."""
    from PIL import Image

    pixels = random.Random(seed).randbytes(width * height * 3)
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(png: bytes) -> str:
    """``png`` as a ``data:image/png;base64,...`` URL, as an OpenAI ``image_url`` part carries it."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _load(folder: Path) -> tuple[Any, Any]:
    key = str(Path(folder).resolve())
    if key not in _LOADED:
        import transformers

        processor = transformers.AutoProcessor.from_pretrained(folder)
        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        _LOADED[key] = (processor, model)
    return _LOADED[key]


def hf_vlm_greedy(folder: Path, messages: list[dict], images: list[bytes], max_new: int) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for ``messages`` with ``images`` (PNG/JPEG bytes, in the order
    of the image parts): (the prompt ids as the processor made them, ``max_new`` generated ids).

    No ``generate()``: every step runs the whole sequence again without a cache, with an all-ones
    attention mask and, where the processor makes them (Gemma 3), the token type ids extended
    with 0 for generated tokens, so the image tokens attend to each other both ways every time."""
    from PIL import Image

    processor, model = _load(folder)
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(png)).convert("RGB") for png in images]
    inputs = dict(processor(text=prompt, images=pil or None, return_tensors="pt"))
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    types = inputs.pop("token_type_ids", None)
    prompt_ids = ids[0].tolist()
    with torch.no_grad():
        for _ in range(max_new):
            extra = dict(inputs)
            if types is not None:
                extra["token_type_ids"] = torch.nn.functional.pad(types, (0, ids.shape[1] - types.shape[1]))
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return prompt_ids, ids[0, len(prompt_ids) :].tolist()
