"""What the HTTP server and the CLI use of an engine: the ``EngineClient`` protocol.

``AsyncEngine`` (async_engine.py) and ``DataParallelEngine`` (data_parallel.py) both
satisfy it structurally, so the server is typed against this and never knows which
it serves. ``model_name`` and ``max_model_len`` are known once ``start()`` has read
the model; the tokenizer and template methods need a started engine too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import (
    TYPE_CHECKING,
    Any,
    Protocol,
    runtime_checkable,
)

if TYPE_CHECKING:
    from aiolm.engine.input import PromptType
    from aiolm.lora.request import LoRARequest
    from aiolm.outputs import PoolingRequestOutput, RequestOutput
    from aiolm.params import SamplingParams
    from aiolm.pooling.config import PoolingConfig
    from aiolm.pooling.params import PoolingParams


class RequestHandle(Protocol):
    """What ``add_request`` returns and ``stream`` reads (each engine keeps its own kind)."""

    @property
    def req_id(self) -> str: ...


class MetricsSource(Protocol):
    def render(self) -> bytes:
        """The Prometheus text exposition of the engine's registry."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    # Read-only here: an engine may hold them as plain attributes or as properties.
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def metrics(self) -> MetricsSource: ...

    @property
    def death_callbacks(self) -> list[Callable[[str], None]]:
        """Each called once, with the reason, when the engine dies."""
        ...

    # -- life cycle and health ------------------------------------------------------
    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def is_healthy(self) -> bool: ...

    def health(self) -> tuple[bool, str | None]: ...

    @property
    def recovering(self) -> str | None:
        """Why no request is taken while workers are being replaced, else None."""
        ...

    @property
    def stalled(self) -> str | None: ...

    @property
    def dead_reason(self) -> str | None: ...

    # -- requests -------------------------------------------------------------------
    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestHandle: ...

    def stream(self, state: Any) -> AsyncIterator[RequestOutput]:
        """The outputs of the request ``add_request`` returned ``state`` for."""
        ...

    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    # -- LoRA adapters (enable_lora) ----------------------------------------------------
    async def load_lora(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Serve the PEFT folder ``path`` as model ``name`` (ParamError naming a problem);
        ``replace``: in place of an adapter served under that name."""
        ...

    async def remove_lora(self, name: str) -> LoRARequest: ...

    def lora(self, name: str) -> LoRARequest | None:
        """The served adapter named ``name``, or None."""
        ...

    def list_loras(self) -> list[LoRARequest]: ...

    # -- pooling models (--runner pooling) --------------------------------------------
    @property
    def runner(self) -> str:
        """ "generate" or "pooling"."""
        ...

    @property
    def pooling_config(self) -> PoolingConfig | None: ...

    @property
    def hidden_size(self) -> int: ...

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]: ...

    def tokenize_pooled(self, text: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]: ...

    def tokenize_pair(self, text: str, text_pair: str, truncate_prompt_tokens: int | None = None) -> dict[str, Any]: ...

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting)."""
        ...

    def kv_cache_usage(self) -> float: ...

    # -- the model's tokenizer and chat template ------------------------------------
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The token ids that end a sequence (the model's EOS), as generation stops on them."""
        ...

    @property
    def generation_config(self) -> dict[str, Any]: ...

    @property
    def sampling_defaults(self) -> dict[str, Any]: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def prompt_too_long(self, text: str) -> str | None: ...

    def clip_prompt(self, text: str, keep_end: bool) -> str: ...

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str: ...

    async def render_chat_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str: ...

    @property
    def takes_images(self) -> bool:
        """Whether the model is a vision-language one (chat image parts are a 400 otherwise)."""
        ...

    async def prompt_with_images(self, text: str, urls: list[tuple[str, str]], field: str) -> dict[str, Any]:
        """A rendered chat and its image URLs ((url, where in the request)) as a prompt for
        ``add_request``; a ParamError names what is wrong with an image."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def token_strings(self, token_ids: list[int]) -> list[str]: ...

    def tokenizer_info(self) -> dict[str, Any]: ...
