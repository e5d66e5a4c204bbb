"""Engine side of a completion: tokenize, check lengths, submit, stream or collect.

Shared by chat and completions. Every path out (finish, error, client gone,
cancellation) aborts what is still running in the engine and drops the request
from the in-flight set, so nothing outlives its HTTP request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Receive

from aiolm.engine.client import EngineClient
from aiolm.engine.errors import (
    EngineBusyError,
    EngineDeadError,
    EngineRecoveringError,
    RequestError,
    RequestTimeoutError,
)
from aiolm.lora.request import LoRARequest
from aiolm.outputs import RequestOutput
from aiolm.params import ParamError, SamplingParams
from aiolm.server.context import ServingContext
from aiolm.server.errors import APIError, bad_request
from aiolm.server.protocol import param_error
from aiolm.server.sse import until_disconnect

_OFFLOAD_CHARS = 8192  # tokenize off the event loop above this


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams | None = None  # this prompt's own, else the Generation's
    images: list[Any] = field(default_factory=list)  # a vision-language prompt's ImageInputs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0) -> dict[str, Any]:
    """The OpenAI ``usage`` object of a chat or text completion; ``cached_tokens``: prompt
    tokens whose KV came from the prefix cache, as OpenAI reports them (None: not known yet,
    a stream's chunk before the engine's first output: no details)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def engine_error(e: BaseException, rename: dict[str, str] | None = None) -> APIError:
    """Map an engine exception to the HTTP error a client should see."""
    if isinstance(e, ParamError):
        return param_error(e, rename)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not available: {e}", code="engine_dead", type="server_error")
    if isinstance(e, EngineBusyError):  # retrying later can succeed: say when
        retry = {"retry-after": str(max(1, round(e.retry_after)))}
        if isinstance(e, EngineRecoveringError):
            return APIError(503, str(e), code="recovering", type="server_error", headers=retry)
        return APIError(429, str(e), code="too_many_requests", headers=retry)
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), code="request_timeout")
    if isinstance(e, RequestError):
        return APIError(400, f"the request failed: {e}", code="request_failed")
    if isinstance(e, APIError):
        return e
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


@dataclass(frozen=True)
class Truncation:
    """vLLM's ``truncate_prompt_tokens`` for generation: a longer prompt keeps ``keep`` of its
    tokens, the last ones (side "left", the end an answer follows on from) or the first."""

    keep: int
    side: str

    def cut(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.keep:
            return ids
        return ids[-self.keep :] if self.side == "left" else ids[: self.keep]


def truncation(engine: EngineClient, keep: int | None, side: str | None) -> Truncation | None:
    """The request's truncation, or None; a 400 for a count no prompt can be cut to."""
    if keep is None:
        if side is not None:
            raise bad_request("'truncation_side' applies with 'truncate_prompt_tokens'", param="truncation_side")
        return None
    room = engine.max_model_len - 1  # a token of the context is left to generate
    if keep == -1:
        keep = room
    if not 1 <= keep <= room:
        raise bad_request(
            f"'truncate_prompt_tokens' must be -1 or from 1 to {room} (this model's context of "
            f"{engine.max_model_len} tokens less one to generate), got {keep}",
            param="truncate_prompt_tokens",
        )
    return Truncation(keep, side or "left")


async def tokenize(
    engine: EngineClient, text: str, add_special_tokens: bool, param: str = "prompt", cut: Truncation | None = None
) -> list[int]:
    """``text``'s token ids; one too long for the context is a 400 unless ``cut`` truncates it."""
    if cut is not None:  # what cannot reach the context is dropped unread, from the side cut
        text = engine.clip_prompt(text, keep_end=cut.side == "left")
    why = engine.prompt_too_long(text)
    if why is not None:  # cannot fit whatever its tokens: refuse before paying for tokenizing
        raise bad_request(why, param=param, code="context_length_exceeded")
    if len(text) > _OFFLOAD_CHARS:
        ids = await asyncio.to_thread(engine.tokenize, text, add_special_tokens)
    else:
        ids = engine.tokenize(text, add_special_tokens)
    if cut is None:
        return ids
    lead = engine.tokenize("", True) if add_special_tokens else []  # a BOS stays, as the tokenizer's cut keeps it
    if lead and ids[: len(lead)] == lead and cut.side == "left" and len(ids) > cut.keep > len(lead):
        return lead + ids[len(lead) :][-(cut.keep - len(lead)) :]
    return cut.cut(ids)


def check_lengths(
    ctx: ServingContext,
    num_prompt: int,
    max_tokens: int | None,
    prompt_param: str,
    max_tokens_param: str,
    min_tokens: int = 0,
) -> None:
    """Refuse what cannot fit in the context, with vLLM's wording (400, not a silent clip)."""
    limit = ctx.engine.max_model_len
    if num_prompt == 0:
        raise bad_request(f"'{prompt_param}' is empty", param=prompt_param)
    if num_prompt >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt} input tokens, which leaves no room for output. Please reduce the length "
            f"of the input.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt + max_tokens > limit:
        if max_tokens >= 2**63:  # a client's integer may have thousands of digits: past what str() takes summed
            total = asked = "more than 2**63"
        else:
            total, asked = f"{num_prompt + max_tokens}", f"{max_tokens}"
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{total} tokens ({num_prompt} in the input, {asked} in the "
            f"completion). Please reduce the length of the input or completion.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    room = limit - num_prompt if max_tokens is None else max_tokens
    if min_tokens > room:
        raise bad_request(f"'min_tokens' ({min_tokens}) is more than can be generated ({room})", param="min_tokens")


def check_admission(ctx: ServingContext, num_prompts: int, n: int, priority: int) -> None:
    """What a generation (or a beam search) must pass before it reaches the engine: a server
    not shutting down, ``priority`` only where enabled, at most --max-seqs-per-request sequences."""
    settings = ctx.settings
    if ctx.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
    if priority and not settings.allow_request_priority:
        raise bad_request(
            "'priority' is not enabled on this server (start it with --allow-request-priority)", param="priority"
        )
    seqs = num_prompts * n
    if seqs > settings.max_seqs_per_request:
        raise bad_request(
            f"this request asks for {seqs} sequences ({num_prompts} prompt(s) x n="
            f"{n}); the limit is {settings.max_seqs_per_request} "
            f"(--max-seqs-per-request)",
            param="n",
        )
    # More than the engine ever holds (each prompt's n sequences go to one data-parallel replica,
    # the prompts are spread): its 429 would be retried for good
    held = settings.max_live_seqs
    if held is not None and (n > held or seqs > held * settings.replicas):
        raise bad_request(
            f"this request asks for {seqs} sequences ({num_prompts} prompt(s) x n={n}); the engine holds at most "
            f"{held} at once (--max-num-seqs running and --max-waiting-requests waiting"
            + (f", on each of {settings.replicas} replicas" if settings.replicas > 1 else "")
            + ")",
            param="n",
        )


class Generation:
    """The engine requests behind one HTTP request (one per prompt, each with ``n`` choices)."""

    def __init__(
        self,
        ctx: ServingContext,
        prompts: list[Prompt],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        rename: dict[str, str] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """``lora_request``: the LoRA adapter the request's model names (None: the base model);
        ``cache_salt``: the client's, naming its prompts' prefix-cache blocks."""
        self.ctx = ctx
        self.prompts = prompts
        self.params = params
        self.request_id = request_id
        self.priority = priority
        self.rename = rename
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.states: list[Any] = []
        self._done: set[str] = set()
        self._loaded = False  # counted in ctx.server_load until the first abort()

    async def start(self, receive: Receive | None = None) -> None:
        """Submit every prompt; if any is refused, abort the ones already in and raise.

        With ``receive`` (the request's ASGI channel) and a grammar to check, whose compile
        can take seconds, a client that leaves meanwhile cancels the submission (and so the
        compile, aiolm/structured/validator.py) and ClientGone is raised.
        """
        if receive is not None and self.params.structured_outputs is not None:
            await until_disconnect(receive, self._start())
        else:
            await self._start()

    async def _start(self) -> None:
        engine = self.ctx.engine
        settings = self.ctx.settings
        check_admission(self.ctx, len(self.prompts), self.params.n, self.priority)
        timeout = settings.request_timeout or None
        self.ctx.server_load += 1
        self._loaded = True
        try:
            for i, p in enumerate(self.prompts):
                rid = self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{i}"
                prompt = {"prompt_token_ids": p.token_ids, "prompt": p.text, "mm_inputs": p.images}
                if self.cache_salt is not None:
                    prompt["cache_salt"] = self.cache_salt
                kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
                if self.lora_request is not None:
                    kwargs["lora_request"] = self.lora_request
                params = self.params if p.params is None else p.params
                state = await engine.add_request(prompt, params, rid, self.priority, **kwargs)
                self.states.append(state)
                self.ctx.inflight.add(rid)
        except BaseException as e:
            await self.abort()
            if isinstance(e, Exception):
                raise engine_error(e, self.rename) from None
            raise

    async def abort(self) -> None:
        """Idempotent, and called on every path out (collect and stream end with it)."""
        if self._loaded:
            self._loaded = False
            self.ctx.server_load -= 1
        for st in self.states:
            if st.req_id not in self._done:
                self._done.add(st.req_id)
                self.ctx.inflight.discard(st.req_id)
                await self.ctx.engine.abort(st.req_id)

    def _finished(self, i: int) -> None:
        st = self.states[i]
        self._done.add(st.req_id)
        self.ctx.inflight.discard(st.req_id)

    async def _one(self, i: int) -> AsyncIterator[RequestOutput]:
        async for out in self.ctx.engine.stream(self.states[i]):
            if out.finished:
                self._finished(i)
            if any(c.finish_reason == "error" for c in out.outputs):  # the engine's or a worker's failure,
                why = out.error or "no reason given"  # not a finish a client can act on: a 500 saying why
                raise APIError(500, f"the request failed: {why}", code="request_failed", type="server_error")
            if self.ctx.draining and any(c.finish_reason == "abort" for c in out.outputs):  # the drain's deadline
                raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
            yield out

    async def collect(self) -> list[RequestOutput]:
        """The final output of every prompt (use OutputKind.FINAL_ONLY)."""
        try:
            finals: list[RequestOutput] = []
            for i in range(len(self.states)):
                last = None
                async for out in self._one(i):
                    last = out
                if last is None:
                    raise APIError(500, "the engine ended a request without output", type="server_error")
                finals.append(last)
            return finals
        except (EngineDeadError, RequestError, EngineBusyError) as e:  # a dead engine, a timeout: not a 500
            raise engine_error(e, self.rename) from None
        finally:
            await self.abort()

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) as they come, merged over prompts."""
        try:
            if len(self.states) == 1:
                async for out in self._one(0):
                    yield 0, out
                return
            async for item in self._merged():
                yield item
        finally:
            await self.abort()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self._one(i):
                    queue.put_nowait((i, out, None))
                queue.put_nowait((i, None, None))
            except Exception as e:
                queue.put_nowait((i, None, e))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self.states))]
        try:
            live = len(tasks)
            while live:
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                if out is None:
                    live -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
