"""Beam search outside the engine core, as vLLM v1 runs it.

The core only ever generates: each step of a search is one engine request per live
beam, for one token with ``logprobs = 2 * beam_width`` (raw logprobs, aiolm/sample/
sampler.py). The beam's tokens are that request's prompt, so the prefix cache serves
all but the last block of it and a step costs about one decode per beam; a step's
requests are submitted together, so they run in one batch. Nothing in the scheduler
or the workers knows about beams, and an aborted search leaves nothing behind: every
step request is aborted on every way out (cancellation, an error, a timeout).

Each beam's candidates are the entries of its step's logprobs (the top ``2 * beam_width``
tokens and the sampled one). A candidate that is an end token (EOS unless
``ignore_eos``, or a ``stop_token_ids`` entry) finishes a beam; the best ``beam_width``
of the rest by cumulative logprob are the next step's beams. At the end the finished
and the live beams are ranked together by ``beam_score`` and the best ``beam_width``
returned, best first. vLLM's ``early_stopping`` does nothing in vLLM v1 and nothing
here: the search runs ``max_tokens`` steps (fewer only where the context ends).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiolm.engine.errors import RequestError, RequestTimeoutError
from aiolm.engine.input import check_in_vocab, image_parts
from aiolm.outputs import Logprob, RequestOutput
from aiolm.params import BeamSearchParams, OutputKind, ParamError, SamplingParams

if TYPE_CHECKING:
    from aiolm.engine.client import EngineClient
    from aiolm.engine.input import PromptType
    from aiolm.lora.request import LoRARequest


@dataclass
class BeamSearchSequence:
    """One beam: vLLM's fields (``tokens`` holds the prompt too), plus ``token_ids`` (the
    generated part, with the end token only if ``include_stop_str_in_output``) and ``score``."""

    tokens: list[int]
    prompt_len: int
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    score: float = 0.0
    finish_reason: str = "length"  # "stop": it ended on an end token
    stop_reason: int | None = None  # that end token
    token_ids: list[int] = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens the first step found in the prefix cache


def beam_score(length: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / length ** length_penalty``, where
    ``length`` counts the prompt and the generated tokens but not a final end token. A
    penalty so large that the power overflows (or underflows to 0) scores 0 (or -inf)."""
    try:
        return cum_logprob / (length**length_penalty)
    except (OverflowError, ZeroDivisionError):  # length >= 2 here: 1 ** anything is 1
        return cum_logprob * (0.0 if length_penalty > 0 else math.inf) if cum_logprob else 0.0


@dataclass
class _Candidate:
    parent: BeamSearchSequence
    token: int
    cum_logprob: float
    entry: dict[int, Logprob]

    def grow(self) -> BeamSearchSequence:
        p = self.parent
        return BeamSearchSequence(p.tokens + [self.token], p.prompt_len, self.cum_logprob, p.logprobs + [self.entry])


async def beam_search(
    engine: EngineClient,
    prompt: PromptType,
    params: BeamSearchParams,
    *,
    request_id: str | None = None,
    priority: int = 0,
    timeout: float | None = None,
    lora_request: LoRARequest | None = None,
    live: set[str] | None = None,
) -> BeamSearchOutput:
    """Beam-search one prompt (anything ``add_request`` takes). ``timeout`` bounds the whole
    search; ``live`` (a server's in-flight set) holds the ids of the step requests running.
    ParamError ``beam_width`` when ``2 * beam_width`` logprobs exceed the engine's bound."""
    bw = params.beam_width
    if _has_images(prompt):  # each step re-sends the beam's tokens, which carry no images
        raise ParamError("use_beam_search", "beam search does not take images yet")
    rid = request_id or f"beam-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    check_in_vocab("stop_token_ids", params.stop_token_ids, engine.vocab_size)
    end_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        end_ids.update(engine.eos_token_ids)
    step_params = SamplingParams(
        temperature=params.temperature,
        max_tokens=1,
        ignore_eos=True,  # an end token is the search's to judge
        logprobs=min(2 * bw, engine.vocab_size),
        output_kind=OutputKind.FINAL_ONLY,
    )
    run = _StepRunner(engine, step_params, rid, priority, deadline, lora_request, live)
    try:
        (first,) = await run.step([prompt])
    except ParamError as e:
        if e.param != "logprobs":
            raise
        raise ParamError(
            "beam_width", f"beam search asks each step for 2 * beam_width = {2 * bw} logprobs: {e.message}"
        ) from None
    prompt_ids = list(first.prompt_token_ids)
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # each step's prompt keeps it
    root = BeamSearchSequence(prompt_ids, len(prompt_ids))
    steps = min(params.max_tokens, engine.max_model_len - len(prompt_ids))
    beams, outs = [root], [first]
    completed: list[BeamSearchSequence] = []
    for step in range(steps):
        if step > 0:
            outs = await run.step([{"prompt_token_ids": b.tokens, "cache_salt": salt} for b in beams])
        candidates: list[_Candidate] = []
        for beam, out in zip(beams, outs):
            entry = _step_logprobs(out, rid)
            for token, lp in entry.items():
                cand = _Candidate(beam, token, beam.cum_logprob + lp.logprob, entry)
                if token in end_ids:
                    done = cand.grow()
                    done.finish_reason, done.stop_reason = "stop", token
                    completed.append(done)
                else:
                    candidates.append(cand)
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)  # stable: ties keep beam order
        beams = [c.grow() for c in candidates[:bw]]
        if not beams:
            break
    return _finish(engine, params, first, completed + beams)


def _step_logprobs(out: RequestOutput, rid: str) -> dict[int, Logprob]:
    c = out.outputs[0] if out.outputs else None
    if c is None or not c.logprobs:
        reason = c.finish_reason if c is not None else out.error
        raise RequestError(f"a step of beam search {rid!r} ended without a token ({reason})")
    return c.logprobs[0]


def _finish(
    engine: EngineClient, params: BeamSearchParams, first: RequestOutput, pool: list[BeamSearchSequence]
) -> BeamSearchOutput:
    for seq in pool:
        ended = seq.finish_reason == "stop"
        seq.score = beam_score(len(seq.tokens) - ended, seq.cum_logprob, params.length_penalty)
    pool.sort(key=lambda s: s.score, reverse=True)
    best = pool[: params.beam_width]
    for seq in best:
        generated = seq.tokens[seq.prompt_len :]
        ended = seq.finish_reason == "stop"
        seq.token_ids = generated if params.include_stop_str_in_output or not ended else generated[:-1]
        # As vLLM: the end token never shows in the text.
        seq.text = engine.decode(generated[:-1] if ended else generated, params.skip_special_tokens)
    return BeamSearchOutput(best, first.prompt, list(first.prompt_token_ids), first.num_cached_tokens)


class _StepRunner:
    """Submits one step's requests together and collects their final outputs; whatever
    way the step ends, no request of it is left running."""

    def __init__(
        self,
        engine: EngineClient,
        params: SamplingParams,
        rid: str,
        priority: int,
        deadline: float | None,
        lora: LoRARequest | None,
        live: set[str] | None,
    ) -> None:
        self.engine, self.params, self.rid, self.priority = engine, params, rid, priority
        self.deadline, self.lora, self.live = deadline, lora, live
        self.count = 0

    def _timeout(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RequestTimeoutError(f"beam search {self.rid!r} ran past its timeout and was stopped")
        return left

    async def step(self, prompts: list[Any]) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        finished: set[str] = set()
        try:
            states = []
            for p in prompts:
                sid = f"{self.rid}-step{self.count}"
                self.count += 1
                kwargs: dict[str, Any] = {} if self.lora is None else {"lora_request": self.lora}
                states.append(await engine.add_request(p, self.params, sid, self.priority, self._timeout(), **kwargs))
                ids.append(sid)
                if self.live is not None:
                    self.live.add(sid)

            async def final(state: Any) -> RequestOutput:
                last = None
                async for out in engine.stream(state):  # a cancel lands inside it: its abort runs
                    last = out
                finished.add(state.req_id)
                if last is None:
                    raise RequestError(f"a step of beam search {self.rid!r} was aborted")
                return last

            tasks = [asyncio.ensure_future(final(s)) for s in states]
            try:
                return list(await asyncio.gather(*tasks))
            finally:  # one failed or we were cancelled: the others stop too (their streams abort)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for sid in ids:
                if self.live is not None:
                    self.live.discard(sid)
                if sid not in finished:
                    await engine.abort(sid)


def _has_images(prompt: Any) -> bool:
    if isinstance(prompt, dict):
        return bool(prompt.get("multi_modal_data") or prompt.get("mm_inputs"))
    return isinstance(prompt, (list, tuple)) and bool(image_parts(prompt))
