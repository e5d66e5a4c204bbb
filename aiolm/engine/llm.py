"""LLM: offline batch generation on a private event loop in a background thread.

The loop lives in its own thread so LLM works from scripts, notebooks (which
already run a loop) and stdin alike. It is a uvloop loop where uvloop is
installed, like the server's and the CLI's.

Shutdown does not rely on ``__del__``: by the time the interpreter clears module
globals its daemon threads are frozen, so waiting on the loop thread from there
hangs forever. A ``weakref.finalize`` stops the engine instead, either when the
LLM is collected or from ``atexit``, while the loop thread still runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.engine.beam_search import BeamSearchOutput, beam_search
from aiolm.engine.input import PromptType
from aiolm.lora.request import LoRARequest
from aiolm.outputs import PoolingRequestOutput, RequestOutput
from aiolm.params import BeamSearchParams, SamplingParams
from aiolm.pooling.params import PoolingParams
from aiolm.pooling.scores import cosine, cross_encoder_score, score_pairs

T = TypeVar("T")
log = logging.getLogger("aiolm.llm")
_SHUTDOWN_TIMEOUT = 30.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    """An event loop running forever in a daemon thread; coroutines are submitted from outside."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aiolm-llm", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if not self.thread.is_alive():
            coro.close()
            raise RuntimeError("the LLM is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except BaseException:  # Ctrl+C (a notebook's interrupt) or the timeout: the coroutine
            future.cancel()  # is cancelled on the loop, which aborts the requests it added
            raise

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


def _shutdown(runner: _LoopThread, engine: AsyncEngine) -> None:
    """Stop the engine (workers, shared memory) and the loop; safe to call twice."""
    try:
        if runner.thread.is_alive():
            runner.run(engine.shutdown(), timeout=_SHUTDOWN_TIMEOUT)
    except Exception:
        log.exception("LLM shutdown failed")
    finally:
        runner.stop()


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Offline, nobody streams: no cap on a step's time unless asked (--max-step-ms).
        engine_args.setdefault("max_step_ms", 0.0)
        args = EngineArgs(model=model, **engine_args)  # a bad argument fails before any thread starts
        self._runner = _LoopThread()
        self.engine = AsyncEngine(args)
        # Runs at collection or at interpreter exit (atexit), whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, self._runner, self.engine)
        try:
            self._run(self.engine.start())
        except BaseException:
            self.close()
            raise
        self.tokenizer = self.engine.tokenizer

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(coro)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. ``lora_request``:
        the LoRA adapter of every prompt, or one per prompt (None: the base model).
        ``priority`` (vLLM's; with scheduling_policy "priority"): every prompt's, or one per
        prompt; lower values are scheduled first."""
        prompts = _prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [params or self.get_default_sampling_params()] * len(prompts)
        else:
            plist = list(params) if isinstance(params, (list, tuple)) else []
            if not all(isinstance(p, SamplingParams) for p in plist) or not plist:
                raise TypeError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        if priority is None or isinstance(priority, int):
            ranks = [priority or 0] * len(prompts)
        else:
            ranks = list(priority)
            if len(ranks) != len(prompts):
                raise ValueError(f"got {len(ranks)} priorities for {len(prompts)} prompts")
        if any(ranks) and self.engine.args.scheduling_policy != "priority":
            raise ValueError(
                "priority needs LLM(..., scheduling_policy='priority'): first come, first served ignores it"
            )
        return self._run(self._generate_all(prompts, plist, use_tqdm, loras, ranks))

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` samples with when given no params: the model's
        generation_config.json recommendations (unless --generation-config vllm)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(
        self,
        conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if not isinstance(conversations, (list, tuple)):
            raise TypeError(
                f"conversations must be a list of messages or a list of them, got {type(conversations).__name__}"
            )
        convs = list(conversations)
        if convs and isinstance(convs[0], dict):
            convs = [convs]  # one conversation
        return self.generate(convs, params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | list[int] | Sequence[PromptType | list[int]],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt (a string, token ids, or a ``{"prompt": ...}``
        / ``{"prompt_token_ids": ...}`` dict), ``params.beam_width`` sequences best first.
        The prompts' searches run together, so their steps share batches
        (aiolm/engine/beam_search.py)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        plist = [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(plist)
        else:
            loras = list(lora_request)
            if len(loras) != len(plist):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(plist)} prompts")
        return self._run(self._beam_search_all(plist, params, loras, use_tqdm))

    async def _beam_search_all(
        self, prompts: list[Any], params: BeamSearchParams, loras: list[LoRARequest | None], use_tqdm: bool
    ) -> list[BeamSearchOutput]:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Beam search", unit="req")

        async def one(p: Any, lora: LoRARequest | None) -> BeamSearchOutput:
            out = await beam_search(self.engine, p, params, lora_request=lora)
            if bar is not None:
                bar.update(1)
            return out

        try:
            return await _all([one(p, lora) for p, lora in zip(prompts, loras)])
        finally:
            if bar is not None:
                bar.close()

    async def _generate_all(
        self,
        prompts: list[Any],
        plist: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
        ranks: list[int],
    ) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Generating", unit="req")
        results: list[RequestOutput | None] = [None] * len(prompts)
        states = []
        try:
            for p, sp, lora, rank in zip(prompts, plist, loras, ranks):
                final = sp.clone(output_kind=_final())
                states.append(await self.engine.add_request(p, final, priority=rank, lora_request=lora))

            async def collect(i: int) -> None:
                async for out in self.engine.stream(states[i]):
                    results[i] = out
                if bar is not None:
                    bar.update(1)

            await _all([collect(i) for i in range(len(states))])
        except BaseException:  # a prompt refused, or cancelled: nothing of the batch runs on
            for st in states:
                await self.engine.abort(st.req_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    # -- pooling models (--runner pooling) ------------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (one batch through the scheduler); outputs in input order."""
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # one prompt's token ids
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}")
        plist = _prompt_list(prompts)
        return self._run(self._encode_all(plist, pooling_params or PoolingParams(), truncate_prompt_tokens))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Embeddings (``outputs.embedding``), as the model's folder pools and normalises them."""
        params = PoolingParams(task="embed", dimensions=dimensions, normalize=normalize)
        return self.encode(prompts, params, truncate_prompt_tokens)

    def classify(
        self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None
    ) -> list[PoolingRequestOutput]:
        """A sequence classifier's logits per prompt (``outputs.logits``)."""
        return self.encode(prompts, PoolingParams(task="classify"), truncate_prompt_tokens)

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate_prompt_tokens: int | None = None
    ) -> list[float]:
        """Relevance of each pair: one text against many, or pairwise over two equal lists.
        A cross-encoder reads each pair at once (the sigmoid of its logit); an embedding
        model gives the cosine of the two embeddings."""
        pairs = score_pairs(text_1, text_2)
        return self._run(self._score_all(pairs, truncate_prompt_tokens))

    async def _encode_all(
        self, prompts: list[Any], params: PoolingParams, truncate: int | None
    ) -> list[PoolingRequestOutput]:
        async def one(p: Any) -> PoolingRequestOutput:
            async for out in self.engine.encode(p, params, truncate_prompt_tokens=truncate):
                return out
            raise RuntimeError("encode yielded nothing")

        return await _all([one(p) for p in prompts])

    async def _score_all(self, pairs: list[tuple[str, str]], truncate: int | None) -> list[float]:
        pc = self.engine.pooling_config
        if pc is not None and pc.is_classifier:
            inputs = [self.engine.tokenize_pair(a, b, truncate) for a, b in pairs]
            outs = await self._encode_all(inputs, PoolingParams(task="score"), None)
            return [cross_encoder_score(o.outputs.data, pc.score_activation) for o in outs]
        texts = sorted({t for pair in pairs for t in pair})
        embs = await self._encode_all(texts, PoolingParams(task="embed"), truncate)
        by_text = {t: o.outputs.data for t, o in zip(texts, embs)}
        return [cosine(by_text[a], by_text[b]) for a, b in pairs]

    def close(self) -> None:
        """Stop the engine and its workers now (also done at exit or when collected)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string or a dict) as a list of one; a list or tuple of prompts as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
    return list(prompts)


async def _all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """``gather`` that, when one fails or the caller is cancelled, cancels the others (each
    aborts its engine request on the way out) and waits for them before raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _final():
    from aiolm.params import OutputKind

    return OutputKind.FINAL_ONLY
