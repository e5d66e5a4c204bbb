"""OutputProcessor: turns the core's token outputs into text, streams and finish reasons.

Per request it keeps one RequestState: a TextStream per sequence (incremental
detokenizer + stop strings), token ids, logprobs. A consumer's stream is a single
slot: each step only marks the state dirty and wakes the consumer, who builds the
output when it reads, so a slow consumer gets merged deltas, never a growing queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiolm.actors import Actor
from aiolm.core.step import EngineCoreOutput, LogprobsLists
from aiolm.engine.detokenizer import TextStream
from aiolm.engine.errors import EngineDeadError, RequestError
from aiolm.engine.messages import StepOutputs
from aiolm.metrics import EngineMetrics, FinishedRequest
from aiolm.outputs import CompletionOutput, Logprob, RequestOutput
from aiolm.params import OutputKind, SamplingParams


@dataclass
class SeqState:
    index: int
    child_id: str
    text: TextStream
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0  # for delta mode: what the consumer has already seen
    sent_tokens: int = 0
    sent_finish: bool = False  # delta mode: the finish reason was delivered, never repeat it
    # Text nobody reads before the end (final-only output, no stop strings) is
    # detokenized once at the finish, a run of ids at a time, not on every step.
    defer_text: bool = False
    num_pushed: int = 0  # token_ids already pushed into ``text``
    last_token_time: float | None = None  # the engine's time of this sequence's latest tokens

    def push_text(self, stop_terminated: bool = False) -> str | None:
        """Push the ids ``text`` has not seen; the stop string they matched, if any."""
        ids = self.token_ids[self.num_pushed :]
        self.num_pushed = len(self.token_ids)
        return self.text.push(ids, stop_terminated=stop_terminated)[1] if ids else None

    def push_each(self, ids: list[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Several ids from one step (speculative decoding), stop-checked one at a time so the
        ids end where the text does: (the stop string matched or None, how many ids were kept)."""
        for k, t in enumerate(ids):
            self.token_ids.append(t)
            stop = self.push_text(stop_terminated=stop_terminated and k == len(ids) - 1)
            if stop is not None:
                return stop, k + 1
        return None, len(ids)


class RequestState:
    """One user request (n sequences) and the single-slot stream its consumer reads."""

    def __init__(
        self, req_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, seqs: list[SeqState]
    ) -> None:
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        self.error: BaseException | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.delivered_final = False
        self.pending_siblings: list[Any] = []  # n > 1: Requests to add once sequence 0 has prefilled
        self.core_request: Any = None  # sequence 0's core Request: when it was first scheduled
        self.expiry: asyncio.TimerHandle | None = None  # the request's timeout, if it has one
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.sent_prompt_logprobs = False  # delta mode: delivered once, with the first output
        self.pooled: list[float] | None = None  # a pooling request's vector, when it finishes
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def wake(self) -> None:
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    async def next_output(self) -> RequestOutput | None:
        """Wait for news and build the output; None once the final one was delivered."""
        while True:
            if self.delivered_final:
                return None
            await self._event.wait()
            self._event.clear()
            if self.error is not None and not self.finished:
                raise self.error
            done = self.finished
            if self.params.output_kind is OutputKind.FINAL_ONLY and not done:
                continue
            out = self.build(delta=self.params.output_kind is OutputKind.DELTA)
            if out is None:
                continue
            self.delivered_final = done
            return out

    def build(self, delta: bool) -> RequestOutput | None:
        outs = []
        for s in self.seqs:
            text = s.text.text
            if delta:
                t, ids = text[s.sent_text :], s.token_ids[s.sent_tokens :]
                lps = s.logprobs[s.sent_tokens :] if s.logprobs is not None else None
                if not t and not ids and (s.finish_reason is None or s.sent_finish):
                    continue
                s.sent_text, s.sent_tokens = len(text), len(s.token_ids)
                s.sent_finish = s.finish_reason is not None
            else:
                t, ids, lps = text, list(s.token_ids), (list(s.logprobs) if s.logprobs is not None else None)
            outs.append(CompletionOutput(s.index, t, ids, s.finish_reason, s.stop_reason, lps, s.cumulative_logprob))
        if delta and not outs and not self.finished:
            return None
        metrics = {}
        if self.first_token_time is not None:
            metrics["ttft"] = self.first_token_time - self.arrival
        if self.finish_time is not None:
            metrics["e2e"] = self.finish_time - self.arrival
        plp = self.prompt_logprobs
        if delta and plp is not None:
            plp = None if self.sent_prompt_logprobs else plp
            self.sent_prompt_logprobs = True
        return RequestOutput(
            self.req_id,
            self.prompt,
            self.prompt_ids,
            outs,
            self.finished,
            self.num_cached_tokens,
            # why a sequence ended with finish_reason "error" (the scheduler's or a worker's message)
            error=str(self.error) if self.error is not None else None,
            metrics=metrics,
            prompt_logprobs=plp,
            kv_transfer_params=self.kv_transfer_params if self.finished else None,
        )


class TokenTexts:
    """Each vocabulary token's text as logprobs show it (``decode([id])``), decoded once.

    A logprobs request asks for up to 21 token texts per generated token; one
    tokenizer call per entry made that work grow with the client's ``logprobs``.
    Here the ids not yet known are decoded in one batched call and kept: the table
    is bounded by the vocabulary, and common tokens cost a dict lookup.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def lookup(self, ids: list[int]) -> dict[int, str]:
        texts = self._texts
        missing = list({t for t in ids if t not in texts})
        if missing:
            batch = getattr(self.tokenizer, "batch_decode", None)
            decoded = (
                batch([[t] for t in missing]) if batch is not None else [self.tokenizer.decode([t]) for t in missing]
            )
            texts.update(zip(missing, decoded))
        return texts


class OutputProcessor(Actor[StepOutputs]):
    name = "output-processor"

    def __init__(
        self,
        tokenizer: Any,
        abort_children: Callable[[list[str]], None],
        on_finish: Callable[[RequestState], None] | None = None,
        stats: dict[str, int] | None = None,
        add_siblings: Callable[[list[Any]], None] | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        super().__init__()
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.abort_children = abort_children
        self.on_finish = on_finish
        self.requests: dict[str, RequestState] = {}
        self.add_siblings = add_siblings
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("generation_tokens", 0)
        self.children: dict[str, tuple[RequestState, SeqState]] = {}
        self.token_texts = TokenTexts(tokenizer)
        self._busy = 0.0  # seconds spent processing since take_busy_time() last read it

    def take_busy_time(self) -> float:
        """Processing time since the last call (the engine core's per-step cost accounting)."""
        busy, self._busy = self._busy, 0.0
        return busy

    def register(
        self, req_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams, child_ids: list[str]
    ) -> RequestState:
        seqs = []
        defer = params.output_kind is OutputKind.FINAL_ONLY and not params.stop
        for i, cid in enumerate(child_ids):
            stream = TextStream.from_params(self.tokenizer, prompt_ids, params)
            seqs.append(
                SeqState(
                    i,
                    cid,
                    stream,
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                    defer_text=defer,
                )
            )
        state = RequestState(req_id, prompt, prompt_ids, params, seqs)
        self.requests[req_id] = state
        for s in seqs:
            self.children[s.child_id] = (state, s)
        return state

    def abort(self, req_id: str) -> list[str]:
        """Mark a request aborted; returns child ids the core must still abort."""
        state = self.requests.pop(req_id, None)
        if state is None:
            return []
        state.pending_siblings = []  # never sent to the core: nothing to abort there
        live = []
        for s in state.seqs:
            if self.children.pop(s.child_id, None) is not None and s.finish_reason is None:
                s.push_text()
                s.finish_reason = "abort"
                live.append(s.child_id)
        self._finished(state)
        return live

    def expire(self, req_id: str, error: BaseException) -> list[str]:
        """End a request with ``error`` (its stream raises it); returns child ids the core must abort."""
        state = self.requests.pop(req_id, None)
        if state is None:
            return []
        state.pending_siblings = []
        live = [
            s.child_id
            for s in state.seqs
            if self.children.pop(s.child_id, None) is not None and s.finish_reason is None
        ]
        state.fail(error)
        self._record(state, time.monotonic())
        return live

    def fail_all(self, error: BaseException) -> None:
        for state in list(self.requests.values()):
            state.fail(error)
        self.requests.clear()
        self.children.clear()

    async def run(self) -> None:
        while True:
            msg = await self.mailbox.receive()
            t0 = time.perf_counter()
            self.process(msg.outputs, msg.timestamp)
            for more in self.mailbox.drain():
                self.process(more.outputs, more.timestamp)
            self._busy += time.perf_counter() - t0

    def process(self, outputs: list[EngineCoreOutput], now: float | None = None) -> None:
        """Apply one step's outputs; ``now`` is when the engine core had them."""
        if now is None:
            now = time.monotonic()
        stopped: list[str] = []
        prompt_tokens = generation_tokens = 0
        gaps: list[float] = []  # inter-token latencies: one per generated token after a sequence's first
        for o in outputs:
            entry = self.children.get(o.req_id)
            if entry is None:
                continue  # finished here already (stop string) or aborted by the user
            state, seq = entry
            if state.pending_siblings and seq.index == 0:
                siblings, state.pending_siblings = state.pending_siblings, []
                if self.add_siblings is not None:
                    self.add_siblings(siblings)
            if o.new_token_ids:
                if state.first_token_time is None:
                    state.first_token_time = now
                    state.num_cached_tokens = o.num_cached_tokens
                state.last_token_time = now
                ids = o.new_token_ids
                # a stop token ends it: EOS (stop_reason None) or one of stop_token_ids (its id)
                token_stop = o.finish_reason == "stop" and not isinstance(o.stop_reason, str)
                if len(ids) > 1 and seq.text.stop_checker.stop:
                    stop_str, k = seq.push_each(ids, token_stop)  # k: the ids kept, up to the stop
                else:
                    seq.token_ids.extend(ids)
                    k = len(ids)
                    stop_str = (
                        None
                        if seq.defer_text and o.finish_reason is None
                        else seq.push_text(stop_terminated=token_stop)
                    )
                generation_tokens += k
                last, seq.last_token_time = seq.last_token_time, now
                if last is None:
                    prompt_tokens += len(state.prompt_ids)
                    if k > 1:
                        gaps += [0.0] * (k - 1)
                elif k == 1:
                    gaps.append(now - last)
                else:  # several tokens in one step share its gap
                    gaps += [(now - last) / k] * k
                if o.prompt_logprobs is not None and state.prompt_logprobs is None:  # n > 1: the first
                    state.prompt_logprobs = [None, *self._entries(o.prompt_logprobs)]
                if seq.logprobs is not None and o.new_logprobs is not None:
                    lp = o.new_logprobs
                    if k < len(ids):
                        lp = lp.slice(0, k)
                    self._add_logprobs(seq, lp)
                if stop_str is not None:  # the string is the reason, as vLLM reports it, even where
                    # the step also ended on a stop token or on the last token allowed
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    if o.finish_reason is None:
                        stopped.append(seq.child_id)
            if o.pooled is not None:
                state.pooled = o.pooled
                state.first_token_time = state.last_token_time = now
                state.num_cached_tokens = o.num_cached_tokens
                prompt_tokens += len(state.prompt_ids)
            if o.kv_transfer_params is not None:
                state.kv_transfer_params = o.kv_transfer_params
            if o.finish_reason is not None and seq.finish_reason is None:
                if o.finish_reason == "error":
                    state.error = RequestError(o.error or "request failed")
                seq.finish_reason, seq.stop_reason = o.finish_reason, o.stop_reason
                seq.push_text()  # an error or abort ending a deferred sequence with no new ids
                seq.text.finish()
            if seq.finish_reason is not None:
                self.children.pop(seq.child_id, None)
                if state.finished:
                    self.requests.pop(state.req_id, None)
                    state.finish_time = now
                    self._finished(state)
            if state.params.output_kind is not OutputKind.FINAL_ONLY or (
                seq.finish_reason is not None and state.finished
            ):
                state.wake()  # a final-only consumer has nothing to read before the end
        if stopped:
            self.abort_children(stopped)
        self.stats["generation_tokens"] += generation_tokens
        if self.metrics is not None:
            self.metrics.step_outputs(prompt_tokens, generation_tokens, gaps)

    def _finished(self, state: RequestState) -> None:
        state.finish_time = state.finish_time or time.monotonic()
        state.wake()
        self._record(state, state.finish_time)
        if self.on_finish is not None:
            self.on_finish(state)

    def _record(self, state: RequestState, finish: float) -> None:
        """The request's metrics, once, when it ends (finished, aborted or timed out)."""
        if self.metrics is None:
            return
        core = state.core_request
        self.metrics.request_finished(
            FinishedRequest(
                reasons=[s.finish_reason or "abort" for s in state.seqs],
                prompt_tokens=len(state.prompt_ids),
                output_tokens=[len(s.token_ids) for s in state.seqs],
                n=state.params.n,
                # a pooling request generates nothing: it has no max_tokens to observe (vLLM's)
                max_tokens=None if getattr(core, "pooling_params", None) else state.params.max_tokens,
                arrival=state.arrival,
                scheduled=getattr(core, "scheduled_time", None),
                first_token=state.first_token_time,
                finish=finish,
            )
        )

    def _entries(self, lp: LogprobsLists) -> list[dict[int, Logprob]]:
        """One dict per token: the token itself (its rank), then the top-N (ranks 1..N);
        the token texts decoded in one batch, each distinct id once."""
        pieces = self.token_texts.lookup([t for ids in lp.token_ids for t in ids])
        out = []
        for i, (ids, vals, rank) in enumerate(zip(lp.token_ids, lp.logprobs, lp.ranks)):
            ranks = lp.entry_ranks[i] if lp.entry_ranks is not None else None
            entry: dict[int, Logprob] = {}
            for j, (tid, val) in enumerate(zip(ids, vals)):
                if tid not in entry:
                    r = ranks[j] if ranks is not None else (rank if j == 0 else j)
                    entry[tid] = Logprob(val, r, pieces[tid])
            out.append(entry)
        return out

    def _add_logprobs(self, seq: SeqState, lp: LogprobsLists) -> None:
        assert seq.logprobs is not None
        for entry, vals in zip(self._entries(lp), lp.logprobs):
            seq.logprobs.append(entry)
            if seq.cumulative_logprob is not None and vals:
                seq.cumulative_logprob += vals[0]


__all__ = ["OutputProcessor", "RequestState", "EngineDeadError"]
