"""Vision-language models (LLaVA, Gemma 3) through the whole engine (worker process, scheduler,
transformers: tiny random models built here (tests/vlm_models.py), float32, greedy."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from aiolm import LLM, ParamError, SamplingParams
from vlm_models import _load, data_url, hf_vlm_greedy, png_image, tiny_gemma3_vision, tiny_llava

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=4 << 20, block_size=16, num_threads=1)
IMAGES = [png_image(seed) for seed in range(1, 5)]
# Long enough that the prompt's first blocks hold text only: the prefix cache may share those.
PREAMBLE = "Look carefully at the picture below and answer in one short sentence, please. " * 2


def chat(*parts: str | bytes) -> list[dict]:
    """One user message of text parts (str) and image parts (PNG bytes, as data URLs)."""
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": data_url(p)}}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def reference(folder: Path, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens (its template takes the parts as images)."""
    plain = [
        {**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]} for m in messages
    ]
    pngs = [png for m in messages for p in m["content"] if p["type"] == "image_url" for png in _png(p)]
    return hf_vlm_greedy(folder, plain, pngs, MAX_NEW)


def _png(part: dict) -> list[bytes]:
    url = part["image_url"]["url"]
    return [png for png in IMAGES if data_url(png) == url]


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def llava(tmp_path_factory, real_source) -> Path:
    return tiny_llava(tmp_path_factory.mktemp("llava"), real_source.path)


CONVERSATIONS = [
    chat(IMAGES[0], "What is this?"),
    chat("Compare", IMAGES[1], "with", IMAGES[2], "in a few words."),
    chat(PREAMBLE, IMAGES[3], "Describe it."),
]


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_image_embeddings_equal_transformers(family, request):
    """LLaVA: the tower up to the feature layer, the class row dropped, the projector. Gemma 3:
    the tower, the pooled grid, the norm and the projection. Both as transformers computes them."""
    from PIL import Image

    from aiolm.checkpoint.source import resolve_model
    from aiolm.model.registry import build_model

    folder = request.getfixturevalue(family)
    processor, hf = _load(folder)
    pixels = processor.image_processor(
        images=[Image.open(io.BytesIO(png)).convert("RGB") for png in IMAGES[:2]], return_tensors="pt"
    )["pixel_values"]
    want = hf.model.get_image_features(pixel_values=pixels).pooler_output
    got = build_model(resolve_model(str(folder)), torch.float32).embed_images(pixels)
    torch.testing.assert_close(got, torch.stack(list(want)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [256, 8], ids=["whole-prompt", "chunks-of-8"])
def test_greedy_tokens_equal_transformers(llava, chunk):
    """One image and two images, each prompt's ids and greedy tokens as transformers'. In
    chunks of 8 tokens every image's 16 placeholders are split across steps: later chunks
    take the rest of the embeddings the encoder cache holds."""
    want = [reference(llava, c) for c in CONVERSATIONS]
    with LLM(model=str(llava), max_num_batched_tokens=chunk, **ENGINE) as llm:
        outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
        encoded = llm.engine.images_encoded
    assert [list(o.prompt_token_ids) for o in outs] == [w[0] for w in want]
    assert tokens(outs) == [w[1] for w in want]
    assert encoded == 4  # each image once, however many chunks its placeholders took


def test_preempted_requests_recompute_their_images(llava):
    """A KV cache of a couple dozen blocks: requests with images are preempted and resumed,
    their images encoded again where the cache let them go, the tokens unchanged."""
    convs = [chat(f"Request {i}: ", IMAGES[i % 4], "Say what you see.") for i in range(8)]
    want = [reference(llava, c)[1] for c in convs]
    with LLM(model=str(llava), **{**ENGINE, "kv_cache_memory": 200 << 10, "max_num_batched_tokens": 64}) as llm:
        got = tokens(llm.chat(convs, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions > 0
    assert [g[:MAX_NEW] for g in got] == want


@pytest.fixture(scope="module")
def engine(llava):
    with LLM(model=str(llava), max_num_batched_tokens=256, limit_mm_per_prompt="image=2", **ENGINE) as llm:
        yield llm


def test_an_image_is_encoded_once_for_three_requests(engine):
    before = engine.engine.images_encoded
    outs = [engine.chat(chat("Hello", IMAGES[2], f"question {i}"), GREEDY, use_tqdm=False)[0] for i in range(3)]
    assert engine.engine.images_encoded - before == 1
    assert all(o.outputs[0].token_ids for o in outs)


def test_another_image_never_hits_the_prefix_cache_past_the_text(engine):
    """The same text with two images: different answers; the second request's prefix-cache
    hit stops at the last block before the image, while the same image again hits past it."""
    after = "Describe it in detail: every colour, every shape, and where each one sits in the frame."
    first = engine.chat(chat(PREAMBLE, IMAGES[0], after), GREEDY, use_tqdm=False)[0]
    other = engine.chat(chat(PREAMBLE, IMAGES[1], after), GREEDY, use_tqdm=False)[0]
    again = engine.chat(chat(PREAMBLE, IMAGES[0], after), GREEDY, use_tqdm=False)[0]
    image_at = list(first.prompt_token_ids).index(49152)  # the first placeholder
    assert first.outputs[0].token_ids != other.outputs[0].token_ids
    assert 0 < other.num_cached_tokens <= image_at // 16 * 16
    assert again.num_cached_tokens > image_at + 16
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


def test_too_many_images_is_refused(engine):
    with pytest.raises(ParamError, match="at most 2") as e:
        engine.chat(chat(IMAGES[0], IMAGES[1], IMAGES[2], "three"), GREEDY, use_tqdm=False)
    assert e.value.param == "messages"


def test_a_broken_image_is_refused(engine):
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ParamError, match="corrupt or truncated|not a PNG"):
        engine.chat(bad, GREEDY, use_tqdm=False)


def test_an_image_to_a_text_model_is_refused():
    with LLM(max_model_len=128, kv_cache_memory=8 << 20, num_threads=1) as llm:
        with pytest.raises(ParamError, match="takes no images"):
            llm.chat(chat("What is it?", IMAGES[0]), GREEDY, use_tqdm=False)


def test_qwen2_text_model_with_the_class_row_kept(tmp_path, real_source):
    """LLaVA over Qwen2 (QKV bias), vision_feature_select_strategy "full": 17 placeholders."""
    folder = tiny_llava(tmp_path / "q", real_source.path, text="qwen2", strategy="full")
    conv = chat("Look:", IMAGES[0], "and", IMAGES[1])
    want = reference(folder, conv)
    with LLM(model=str(folder), max_num_batched_tokens=256, **ENGINE) as llm:
        out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == want[0]
    assert list(out.outputs[0].token_ids) == want[1]


# -- Gemma 3: a SigLIP tower, pooled to 4 tokens per image that attend to each other both ways --


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, real_source) -> Path:
    return tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3"), real_source.path)


@pytest.mark.parametrize("chunk", [256, 6], ids=["whole-prompt", "chunks-of-6"])
def test_gemma3_greedy_tokens_equal_transformers(gemma3, chunk):
    """transformers lets an image's soft tokens see each other both ways: so must we. In
    chunks of 6 a chunk would end inside an image: the scheduler ends it before the image
    instead, and the image runs whole in the next chunk."""
    want = [reference(gemma3, c) for c in CONVERSATIONS]
    with LLM(model=str(gemma3), max_num_batched_tokens=chunk, **ENGINE) as llm:
        outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs] == [w[0] for w in want]
    assert tokens(outs) == [w[1] for w in want]


def test_gemma3_image_longer_than_a_step_is_refused(gemma3):
    """Its 4 soft tokens must run in one step: a 3-token step can never take them."""
    with LLM(model=str(gemma3), max_num_batched_tokens=3, **ENGINE) as llm:
        with pytest.raises(ParamError, match="in one step"):
            llm.chat(chat(IMAGES[0], "What?"), GREEDY, use_tqdm=False)


def test_gemma3_preempted_requests_recompute_their_images(gemma3):
    convs = [chat(f"Request {i}: ", IMAGES[i % 4], "Say what you see.") for i in range(8)]
    want = [reference(gemma3, c)[1] for c in convs]
    with LLM(model=str(gemma3), **{**ENGINE, "kv_cache_memory": 100 << 10, "max_num_batched_tokens": 64}) as llm:
        got = tokens(llm.chat(convs, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions > 0
    assert [g[:MAX_NEW] for g in got] == want


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_tensor_parallel_towers_give_the_same_tokens(family, llava, gemma3):
    """Two ranks: each runs half of every tower's heads and the projector's columns, then
    the all-reduce; the tokens are one rank's."""
    folder = llava if family == "llava" else gemma3
    want = [reference(folder, c)[1] for c in CONVERSATIONS[:2]]
    with LLM(model=str(folder), tensor_parallel_size=2, max_num_batched_tokens=256, **ENGINE) as llm:
        assert tokens(llm.chat(CONVERSATIONS[:2], GREEDY, use_tqdm=False)) == want


def test_beam_search_with_images_is_refused(engine):
    """Each beam step re-sends the beam's tokens, which carry no images: refused, not wrong."""
    from aiolm import BeamSearchParams

    with pytest.raises(ParamError, match="does not take images") as e:
        prompt = {"prompt": "<image>What?", "multi_modal_data": {"image": data_url(IMAGES[0])}}
        engine.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4))
    assert e.value.param == "use_beam_search"


def test_image_tokens_without_images_and_lopsided_images_are_refused(engine):
    """A typed <image> with no image would run as an embedding the model never saw; a 1 x N
    image would be N times the processor's square once its shortest side is resized."""
    with pytest.raises(ParamError, match="image tokens may only stand for images") as e:
        engine.generate({"prompt": "What is <image> here?"}, GREEDY, use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(ParamError, match="not with prompt_token_ids"):
        engine.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": data_url(IMAGES[0])}}, GREEDY)
    from PIL import Image

    strip = io.BytesIO()
    Image.new("RGB", (40_000, 1)).save(strip, format="PNG")
    with pytest.raises(ParamError, match="resizes its shortest side to 32") as e:
        engine.chat(chat("What?", strip.getvalue()), GREEDY, use_tqdm=False)
    assert e.value.param == "messages[0].content[1]"  # the part that holds it


def test_a_peft_adapter_of_llava_gives_its_merged_models_tokens(llava, tmp_path):
    """PEFT names a LLaVA's decoder layers ``model.language_model.layers.N`` (it was refused as
    no layer of the model): served as the decoder's own, with and without an image, giving the
    tokens of the model with the adapter merged in."""
    import shutil

    import peft
    import transformers

    from aiolm import LoRARequest

    model = transformers.AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")
    lora = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    lora.save_pretrained(tmp_path / "adapter")
    merged = shutil.copytree(llava, tmp_path / "merged")
    lora.merge_and_unload().save_pretrained(merged)
    conversations = [chat(IMAGES[0], "What is this?"), chat("Say something.")]
    want = [reference(merged, c)[1] for c in conversations]
    assert want != [reference(llava, c)[1] for c in conversations], "the adapter must change the tokens"
    with LLM(model=str(llava), enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        adapter = LoRARequest("vision-chat", 1, str(tmp_path / "adapter"))
        assert tokens(llm.chat(conversations, GREEDY, use_tqdm=False, lora_request=adapter)) == want


def test_adapters_leave_the_vision_tower_alone(gemma3, tmp_path):
    """The tower's projections had LoRA slots and ran with the text step's adapter rows: a step
    with more image rows than those rows hold failed (and a few such failures killed the
    engine). Adapters target the language model only, as vLLM's do: the same tokens as an
    engine whose step budget holds the rows whole."""
    import peft
    import transformers

    from aiolm import LoRARequest

    model = transformers.AutoModelForImageTextToText.from_pretrained(gemma3, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "adapter")
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    many = [chat(PREAMBLE * 8, *[png_image(100 + i) for i in range(20)], "Describe.")]
    got = []
    for budget in (256, 8192):
        args = {**ENGINE, "max_model_len": 1024, "kv_cache_memory": 16 << 20, "max_num_batched_tokens": budget}
        with LLM(model=str(gemma3), enable_lora=True, max_lora_rank=8, limit_mm_per_prompt="image=20", **args) as llm:
            got.append(
                tokens(
                    llm.chat(many, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False, lora_request=adapter)
                )
            )
    assert got[0] == got[1] and len(got[0][0]) == 2
