"""InputProcessor: validate, template and tokenize a request before it reaches the core.

Everything a user can get wrong is caught here and raised as ParamError naming
the field, so the core and workers only ever see valid requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiolm.engine.chat_messages import shaped_for
from aiolm.multimodal.inputs import ImageInput
from aiolm.params import MAX_CACHE_SALT_CHARS, ParamError, SamplingParams

if TYPE_CHECKING:
    from aiolm.multimodal.media import MediaLimits
    from aiolm.multimodal.processor import ImagePrompts

PromptType = str | dict[str, Any] | Sequence[dict[str, Any]]
_LARGE_PROMPT_CHARS = 8192  # tokenize, and render chat templates, off the loop above this
_LARGE_CHAT_MESSAGES = 64  # render off the loop with more messages than this, whatever their size
_IMAGE_REQUESTS = 2  # requests holding decoded images at once (InputProcessor._with_decoded)


def resolve_truncation(truncate: int | None, max_tokens: int) -> int | None:
    """A pooling request's ``truncate_prompt_tokens`` as the number of tokens to keep (None:
    no cut; -1: ``max_tokens``), refused unless it is a positive integer within ``max_tokens``."""
    if truncate is None:
        return None
    if isinstance(truncate, bool) or not isinstance(truncate, int) or (truncate < 1 and truncate != -1):
        raise ParamError("truncate_prompt_tokens", f"must be a positive integer or -1, got {truncate!r}")
    if truncate > max_tokens:
        raise ParamError(
            "truncate_prompt_tokens", f"{truncate} is more than this model takes in one input ({max_tokens})"
        )
    return max_tokens if truncate == -1 else truncate


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)  # a vision-language prompt's, in order
    cache_salt: str | None = None  # names its prefix-cache blocks with its tokens (kv_cache.py)


# content part types that carry an image: OpenAI's chat and Responses spellings, vLLM's
# offline one (a PIL image), and the plain marker a chat template takes
IMAGE_PARTS = ("image_url", "input_image", "image_pil", "image")


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        max_logprobs: int = 20,
        images: ImagePrompts | None = None,
        media_limits: MediaLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.lower_case = False  # a sentence-transformers folder's do_lower_case: pooled texts lowercased
        self.images = images  # a vision-language model's processor; None: text only
        self.media_limits = media_limits
        self._image_slots: asyncio.Semaphore | None = None  # made on first use, in the serving loop
        self._truncate_lock = threading.Lock()
        self._truncating_tokenizer: Any = None  # _truncating's copy, made on first use
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_logprobs = max_logprobs
        self._ids = itertools.count()
        # No token covers more characters than the longest vocabulary entry, so a text
        # longer than this (doubled: normalizers may drop characters) cannot fit in the
        # context; refusing it unread keeps megabyte prompts from costing seconds of CPU.
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        longest = max((len(t) for t in vocab), default=0)
        self.max_prompt_chars: int | None = 2 * max_model_len * longest if longest else None

    def too_long(self, text: str) -> str | None:
        """Why ``text`` cannot fit in the context without tokenizing it, or None."""
        if self.max_prompt_chars is None or len(text) <= self.max_prompt_chars:
            return None
        return (
            f"the prompt has {len(text)} characters, more than can fit in this model's maximum context "
            f"length of {self.max_model_len} tokens (at most {self.max_prompt_chars} characters)"
        )

    def clip(self, text: str, keep_end: bool) -> str:
        """``text`` cut to the characters that could reach the context (``too_long``'s bound),
        keeping its end or its start: all that a truncating tokenization can keep of it."""
        n = self.max_prompt_chars
        if n is None or len(text) <= n:
            return text
        return text[-n:] if keep_end else text[:n]

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ParamError("messages", "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ParamError(f"messages[{i}]", "must be an object with a 'role'")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ParamError("messages", "this model has no chat template; use a plain prompt")
        if isinstance(template, str):  # (named templates: transformers picks one itself)
            messages = shaped_for(template, messages)
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **template_kwargs,
            )
        except Exception as e:  # jinja errors: the messages do not fit the template
            raise ParamError("messages", f"cannot apply the chat template: {e}") from e

    async def chat_prompt_async(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """``chat_prompt`` in a thread when the conversation is large (the template's
        work grows with it), so a big chat body cannot stall the event loop."""
        size = len(messages) if isinstance(messages, (list, tuple)) else 0
        chars = (
            sum(
                len(m["content"])
                for m in messages[: _LARGE_CHAT_MESSAGES + 1]
                if isinstance(m, dict) and isinstance(m.get("content"), str)
            )
            if size
            else 0
        )
        if size > _LARGE_CHAT_MESSAGES or chars > _LARGE_PROMPT_CHARS:
            return await asyncio.to_thread(
                self.chat_prompt, messages, add_generation_prompt, chat_template, **template_kwargs
            )
        return self.chat_prompt(messages, add_generation_prompt, chat_template, **template_kwargs)

    async def process(self, prompt: PromptType) -> ProcessedPrompt:
        """A string, {"prompt_token_ids": [...]}, {"prompt": str} or a list of chat messages.
        A dict's ``cache_salt`` (vLLM's): its blocks are shared only with prompts of the same
        salt, so one tenant cannot learn from cache hits what another has sent."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        check_cache_salt(salt)
        processed = await self._process(prompt)
        processed.cache_salt = salt
        return processed

    async def _process(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt and "multi_modal_data" in prompt:
            raise ParamError("multi_modal_data", "give images with a text prompt, not with prompt_token_ids")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ParamError("prompt_token_ids", "must be a list of integers")
            images = prompt.get("mm_inputs") or []  # already processed (the server's chat path)
            if images and not all(isinstance(i, ImageInput) for i in images):
                raise ParamError("mm_inputs", "must be ImageInputs from the engine's own processing")
            return self._check(ProcessedPrompt(prompt.get("prompt"), list(ids), list(images)))
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            return await self._prompt_with_images(prompt)
        if isinstance(prompt, dict) and "prompt" in prompt:
            prompt = prompt["prompt"]
        if isinstance(prompt, (list, tuple)):
            if image_parts(prompt):
                return await self._chat_with_images(prompt)
            text = await self.chat_prompt_async(prompt)
            return self._check(ProcessedPrompt(text, await self._encode(text, special=False)))
        if not isinstance(prompt, str):
            raise ParamError("prompt", f"must be a string, token ids or chat messages, got {type(prompt).__name__}")
        return self._check(ProcessedPrompt(prompt, await self._encode(prompt, special=True)))

    def _image_processor(self, field: str) -> ImagePrompts:
        if self.images is None:
            raise ParamError(field, "this model takes no images: send text content only")
        return self.images

    async def _chat_with_images(self, messages: Sequence[dict[str, Any]]) -> ProcessedPrompt:
        """Chat messages with image parts: each image fetched and decoded within the server's
        limits, the parts replaced by the template's image marker, then the model's processor
        expands the markers into placeholder tokens."""
        images = self._image_processor("messages")
        found = image_parts(messages)
        images.check_count(len(found), "messages")
        fetched = [(await self._fetch(part, where), where) for part, where in found]
        text = await self.chat_prompt_async([_with_image_markers(m) for m in messages])
        return await self._with_decoded(text, fetched, "messages")

    async def with_images(
        self, text: str, pictures: list[tuple[Any, str]], field: str, special: bool = False, length: bool = True
    ) -> ProcessedPrompt:
        """``text`` (a rendered chat, or a prompt with the model's image markers) and its
        decoded images ((image, where in the request)) through the model's processor: ids
        with each marker expanded into its placeholders, and the images' inputs."""
        why = self.too_long(text)
        if why is not None:
            raise ParamError(field, why)
        images, names = [p for p, _ in pictures], [where for _, where in pictures]
        ids, inputs = await self._image_processor(field).encode(text, images, special, names)
        return self._check(ProcessedPrompt(text, ids, inputs), length)

    async def with_image_urls(self, text: str, urls: Sequence[tuple[str, str]], field: str) -> ProcessedPrompt:
        """``with_images`` of the images at ``urls`` ((url, where it was in the request)),
        fetched and decoded within the server's limits, refused unless this model takes that many.
        The context length is the caller's to check (the server's routes do, with their wording)."""
        if urls:
            self._image_processor(urls[0][1]).check_count(len(urls), "messages")
        fetched = [(await self._fetch({"type": "image_url", "image_url": url}, where), where) for url, where in urls]
        return await self._with_decoded(text, fetched, field, length=False)

    async def _with_decoded(
        self, text: str, fetched: list[tuple[Any, str]], field: str, special: bool = False, length: bool = True
    ) -> ProcessedPrompt:
        """``with_images`` of ``_fetch``'s images ((result, where in the request)), decoded in a
        slot held until the processor's output. Decoded images (up to --max-image-pixels each,
        several a prompt) are the largest thing a client can make the server hold, and requests
        decode before any admission: so only ``_IMAGE_REQUESTS`` requests hold them at a time
        (their encoded bytes wait outside)."""
        if self._image_slots is None:
            self._image_slots = asyncio.Semaphore(_IMAGE_REQUESTS)
        async with self._image_slots:
            pictures = [(await self._decode(f, where), where) for f, where in fetched]
            return await self.with_images(text, pictures, field, special, length)

    async def _prompt_with_images(self, prompt: dict[str, Any]) -> ProcessedPrompt:
        """vLLM's offline form: {"prompt": text with the model's image markers,
        "multi_modal_data": {"image": an image or a list of them}} (PIL images, or URLs)."""
        images = self._image_processor("multi_modal_data")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ParamError("multi_modal_data", "must be {'image': an image or a list of images}")
        given = data.get("image", [])
        given = list(given) if isinstance(given, (list, tuple)) else [given]
        images.check_count(len(given), "multi_modal_data")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ParamError("prompt", "a prompt with multi_modal_data must be a string")
        fetched = [
            (
                await self._fetch(
                    {"type": "image_url", "image_url": g}
                    if isinstance(g, str)
                    else {"type": "image_pil", "image_pil": g},
                    f"multi_modal_data.image[{i}]",
                ),
                f"multi_modal_data.image[{i}]",
            )
            for i, g in enumerate(given)
        ]
        return await self._with_decoded(text, fetched, "prompt", special=True)

    async def _fetch(self, part: dict[str, Any], where: str) -> Any:
        """One content part's image as its encoded bytes (a URL's), or an image given whole."""
        from aiolm.multimodal.media import MediaLimits, fetch_image

        kind = part.get("type")
        value = part.get(kind) if isinstance(kind, str) else None
        if kind == "image_pil" or (kind == "image" and value is not None and not isinstance(value, str)):
            if getattr(value, "convert", None) is None:
                raise ParamError(where, "must be a PIL image")
            return value
        if kind == "image_url" and isinstance(value, dict):
            value = value.get("url")
        if not isinstance(value, str) or not value:
            raise ParamError(where, "an image part needs a URL (data:, http(s): or file:)")
        return await fetch_image(value, self.media_limits or MediaLimits(), where)

    async def _decode(self, fetched: Any, where: str) -> Any:
        """``_fetch``'s result as an RGB image."""
        from aiolm.multimodal.media import MediaLimits, decode_image, to_rgb

        if isinstance(fetched, bytes):
            return await decode_image(fetched, self.media_limits or MediaLimits(), where)
        return to_rgb(fetched)

    async def _encode(self, text: str, special: bool) -> list[int]:
        why = self.too_long(text)
        if why is not None:
            raise ParamError("prompt", why)
        if len(text) > _LARGE_PROMPT_CHARS:
            return await asyncio.to_thread(self.encode, text, special)
        return self.encode(text, special)

    async def process_pooling(
        self, prompt: PromptType, truncate: int | None, max_tokens: int
    ) -> tuple[ProcessedPrompt, list[int] | None]:
        """A pooling prompt and its token type ids (a cross-encoder pair's, else None): a string,
        token ids, or ``{"prompt_token_ids": ..., "token_type_ids": ...}``. The whole prompt
        is pooled, so it may fill the context (``max_tokens``) but not pass it, unless
        ``truncate`` (-1: ``max_tokens``) asks to keep only its first tokens."""
        truncate = resolve_truncation(truncate, max_tokens)
        types = None
        text: str | None = None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            types = prompt.get("token_type_ids")
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, str):
            text = prompt
            ids = (
                await asyncio.to_thread(self.pooled_ids, text, truncate)
                if len(text) > _LARGE_PROMPT_CHARS
                else self.pooled_ids(text, truncate)
            )
        else:
            raise ParamError("input", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ParamError("input", "token ids must be a list of integers")
        ids = list(ids)
        if types is not None and (not isinstance(types, (list, tuple)) or len(types) != len(ids)):
            # (their values are the engine's to check: it knows the model's type vocabulary)
            raise ParamError("token_type_ids", f"must be a list of one type id per token ({len(ids)})")
        if truncate is not None and len(ids) > truncate:
            ids = ids[:truncate]
            types = list(types[:truncate]) if types is not None else None
        if not ids:
            raise ParamError("input", "the input is empty")
        check_in_vocab("input", ids, self.vocab_size)
        if len(ids) > max_tokens:
            raise ParamError(
                "input",
                f"the input has {len(ids)} tokens; this model takes at most {max_tokens} "
                "(set truncate_prompt_tokens to cut it)",
            )
        return ProcessedPrompt(text, ids), (list(types) if types is not None else None)

    def pooled_ids(self, text: str, truncate: int | None) -> list[int]:
        """A pooling input's token ids, cut to ``truncate`` (already resolved: see
        ``resolve_truncation``); ParamError when, uncut, its text cannot fit."""
        if truncate is None:
            why = self.too_long(text)
            if why is not None:
                raise ParamError("input", why)
        return self._encode_pooled(text, truncate)

    def _encode_pooled(self, text: str, truncate: int | None) -> list[int]:
        """Truncated by the tokenizer, which keeps the special tokens (a BERT's [SEP]) in."""
        if self.lower_case:
            text = text.lower()
        if truncate is None:
            return self.encode(text)
        with self._truncating() as tok:
            return list(tok(text, truncation=True, max_length=truncate)["input_ids"])

    @contextlib.contextmanager
    def _truncating(self) -> Iterator[Any]:
        """A copy of the tokenizer for calls that truncate, one at a time. A fast tokenizer
        switches its truncation setting in place; done to the shared one in a thread while
        the loop tokenizes, it fails ("Already borrowed"). The shared one never truncates."""
        with self._truncate_lock:
            if self._truncating_tokenizer is None:
                self._truncating_tokenizer = copy.deepcopy(self.tokenizer)
            yield self._truncating_tokenizer

    def encode_pair(self, text: str, pair: str, truncate: int | None, max_tokens: int) -> dict[str, Any]:
        """The ids (and token type ids, where the tokenizer makes segments) of a text pair."""
        for name, value in (("text_1", text), ("text_2", pair)):
            if not isinstance(value, str):
                raise ParamError(name, f"must be a string, got {type(value).__name__}")
        limit = resolve_truncation(truncate, max_tokens)  # checked before the tokenizer sees it
        if self.lower_case:
            text, pair = text.lower(), pair.lower()
        if limit is None:
            why = self.too_long(text + pair)
            if why is not None:
                raise ParamError("input", why.replace("the prompt", "the pair", 1))
        if limit is None:
            enc = self.tokenizer(text, pair, truncation=False)
        else:
            with self._truncating() as tok:
                enc = tok(text, pair, truncation=True, max_length=limit)
        out: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
        if "token_type_ids" in enc:
            out["token_type_ids"] = list(enc["token_type_ids"])
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _check(self, p: ProcessedPrompt, length: bool = True) -> ProcessedPrompt:
        """``p``'s ids and images fit the model; with ``length``, its context too (a server
        route checks that itself, naming its own fields)."""
        if self.images is not None:
            self.images.check_placeholders(p.token_ids, p.images, "prompt")
        n = len(p.token_ids)
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        check_in_vocab("prompt", p.token_ids, self.vocab_size)
        if length and n >= self.max_model_len:
            raise ParamError(
                "prompt",
                f"the prompt has {n} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, and at least one must be left for output",
            )
        return p

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """Validate against the model and fill in the model's EOS ids."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ParamError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
        unbounded = self.max_logprobs == -1
        whole: dict[str, int] = {}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:  # the whole vocabulary, only where the operator allows any count
                if not unbounded:
                    raise ParamError(
                        name,
                        f"-1 (the whole vocabulary) needs the engine started with --max-logprobs -1; "
                        f"this one allows at most {self.max_logprobs}",
                    )
                whole[name] = self.vocab_size
            elif value is not None and not unbounded and value > self.max_logprobs:
                raise ParamError(name, f"at most {self.max_logprobs} top logprobs, got {value}")
            elif value is not None and value > self.vocab_size:
                raise ParamError(name, f"at most the vocabulary's {self.vocab_size} tokens, got {value}")
        check_in_vocab("logprob_token_ids", params.logprob_token_ids or (), self.vocab_size)
        if params.logprob_token_ids and params.logprobs is None:
            whole["logprobs"] = 0  # the sampled token's, then the named ones
        if whole:
            params = params.clone(**whole)
        check_in_vocab("logit_bias", params.logit_bias or {}, self.vocab_size)
        check_in_vocab("stop_token_ids", params.stop_token_ids, self.vocab_size)
        check_in_vocab("allowed_token_ids", params.allowed_token_ids or (), self.vocab_size)
        check_in_vocab("bad_words_token_ids", itertools.chain(*(params.bad_words_token_ids or ())), self.vocab_size)
        params = params.clone(eos_token_ids=self.eos_token_ids)
        if params.allowed_token_ids is not None:  # a step with every token masked would emit token 0
            banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
            if all(t in banned for t in params.allowed_token_ids):
                raise ParamError("allowed_token_ids", "no token can be generated: every allowed token is a bad word")
            ends = params.stop_ids() if params.min_tokens > 0 else set()
            if all(t in banned or t in ends for t in params.allowed_token_ids):
                raise ParamError(
                    "allowed_token_ids",
                    "no token can be generated before min_tokens: each allowed one ends the sequence or is a bad word",
                )
        return params


def check_cache_salt(salt: Any) -> None:
    """ParamError unless ``salt`` is None or a string of 1 to MAX_CACHE_SALT_CHARS characters."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ParamError("cache_salt", "must be a non-empty string")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ParamError("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")


def check_token_types(types: Any, num_tokens: int, type_vocab_size: int) -> list[int]:
    """``types`` as a list, unless they are not segment ids the model has (below
    ``type_vocab_size``; a decoder has none), one per token: then a ParamError."""
    if type_vocab_size < 1:
        raise ParamError("token_type_ids", "this model takes no token type ids")
    if (
        not isinstance(types, (list, tuple))
        or len(types) != num_tokens
        or not all(type(t) is int and 0 <= t < type_vocab_size for t in types)
    ):
        raise ParamError(
            "token_type_ids", f"must be a list of ints from 0 to {type_vocab_size - 1}, one per token ({num_tokens})"
        )
    return list(types)


def check_in_vocab(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """ParamError naming ``field`` for the first id outside ``[0, vocab_size)``."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def image_parts(messages: Sequence[Any]) -> list[tuple[dict[str, Any], str]]:
    """Each image part of chat ``messages`` with where it is (for error messages), in order."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, (list, tuple)):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                found.append((part, f"messages[{i}].content[{j}]"))
    return found


def _with_image_markers(message: dict[str, Any]) -> dict[str, Any]:
    """The message with each image part as the chat template's ``{"type": "image"}`` and
    each text part as ``{"type": "text", "text": ...}`` (the Responses API's input_text too)."""
    content = message.get("content")
    if not isinstance(content, (list, tuple)):
        return message
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            parts.append({"type": "image"})
        elif kind in ("text", "input_text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            raise ParamError("messages", f"unsupported content part {kind!r}; supported: text, image_url")
    return {**message, "content": parts}
