"""LLM: offline batch generation on a private event loop in a background thread.

The loop lives in its own thread so LLM works from scripts, notebooks (which
already run a loop) and stdin alike.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Sequence, TypeVar

from aiolm.config import EngineArgs
from aiolm.engine.async_engine import AsyncEngine
from aiolm.engine.input import PromptType
from aiolm.outputs import RequestOutput
from aiolm.params import SamplingParams

T = TypeVar("T")


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aiolm-llm", daemon=True)
        self._thread.start()
        self.engine = AsyncEngine(EngineArgs(model=model, **engine_args))
        try:
            self._run(self.engine.start())
        except BaseException:
            self.close()
            raise
        self.tokenizer = self.engine.tokenizer

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        return self._run(self._generate_all(prompts, plist, use_tqdm))

    def chat(self, conversations: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        convs = list(conversations)
        if convs and isinstance(convs[0], dict):
            convs = [convs]  # one conversation
        return self.generate(convs, params, use_tqdm)  # type: ignore[arg-type]

    async def _generate_all(self, prompts: list[Any], plist: list[SamplingParams],
                            use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Generating", unit="req")
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            states = [await self.engine.add_request(p, sp.clone(output_kind=_final())) for p, sp in zip(prompts, plist)]

            async def collect(i: int) -> None:
                async for out in self.engine.stream(states[i]):
                    results[i] = out
                if bar is not None:
                    bar.update(1)

            await asyncio.gather(*(collect(i) for i in range(len(states))))
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self.engine.shutdown())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _final():
    from aiolm.params import OutputKind

    return OutputKind.FINAL_ONLY
