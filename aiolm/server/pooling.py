"""The pooling APIs: /v1/embeddings, /pooling, /score, /rerank and /classify.

A pooling server (``--runner pooling``) answers these and refuses the generation routes;
a generation server does the reverse (``only_for``), each with a 400 naming the model.

Every input of a request (a text, a token list, a pair) is one engine request, and a
request's inputs are submitted together, so the scheduler batches them into the same
steps: up to a window of two steps' worth (``_window``) at a time, which keeps the next
step full while one runs and keeps one request from filling the engine's waiting queue
(a 429 that retrying could never cure). Every path out (an answer, an error, a client
gone, a shutdown) leaves no engine request behind: the pending inputs are cancelled,
and an encode left early aborts.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from starlette.requests import Request
from starlette.responses import Response

from aiolm.config import EngineArgs
from aiolm.engine.client import EngineClient
from aiolm.engine.errors import EngineBusyError, EngineDeadError, RequestError, RequestTimeoutError
from aiolm.outputs import PoolingRequestOutput
from aiolm.params import ParamError
from aiolm.pooling.config import PoolingConfig
from aiolm.pooling.params import PoolingParams
from aiolm.pooling.scores import class_probs, cosine, cross_encoder_score
from aiolm.server.context import ServingContext
from aiolm.server.errors import APIError, bad_request, json_response
from aiolm.server.generation import engine_error
from aiolm.server.http import check_model, context, log_extra, read_json
from aiolm.server.pooling_protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    PoolingFields,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from aiolm.server.protocol import param_error, parse
from aiolm.server.sse import until_disconnect

Prompt = str | dict[str, Any]  # a text, or {"prompt_token_ids": ...[, "token_type_ids": ...]}
M = TypeVar("M", bound=PoolingFields)
_OFFLOAD_CHARS = 8192  # tokenize a request's pairs off the event loop above this many characters
# ParamError fields that are the request's, not one input's; any other names the input.
_REQUEST_FIELDS = frozenset({"dimensions", "normalize", "truncate_prompt_tokens", "model"})


class _Configured(Protocol):
    args: EngineArgs  # both engines keep theirs; EngineClient does not list it


# -- which server answers which route -------------------------------------------------------


def runner_of(ctx: ServingContext) -> str:
    """'pooling' or 'generate'."""
    return ctx.engine.runner


def require_runner(ctx: ServingContext, wanted: str, path: str) -> None:
    if runner_of(ctx) == wanted:
        return
    name = ctx.model_name
    if wanted == "pooling":
        msg = (
            f"'{path}' needs a pooling model, and this server generates text with '{name}'; serve an "
            "embedding, reranking or classification model with `aiolm serve --runner pooling`"
        )
    else:
        msg = (
            f"'{path}' generates text, and this server runs '{name}' as a pooling model (--runner pooling): "
            "it answers /v1/embeddings, /pooling, /score, /rerank and /classify"
        )
    raise bad_request(msg, param="model", code="wrong_runner")


Endpoint = Callable[[Request], Awaitable[Any]]


def only_for(runner: str, endpoint: Endpoint) -> Endpoint:
    """``endpoint`` on a server of ``runner``; a 400 naming the model on any other."""

    async def handler(request: Request) -> Any:
        require_runner(context(request), runner, request.url.path)
        return await endpoint(request)

    return handler


# -- running inputs through the engine --------------------------------------------------------


@dataclass
class Job:
    """One engine request: its prompt, its params, and the request field it came from (for errors)."""

    prompt: Prompt
    params: PoolingParams
    param: str


async def _parse(request: Request, model: type[M]) -> tuple[ServingContext, M]:
    ctx = context(request)
    req = parse(model, await read_json(request, ctx.settings.max_request_bytes), ctx.settings.limits)
    check_model(ctx, req.model)
    return ctx, req


def _config(ctx: ServingContext) -> PoolingConfig:
    cfg = ctx.engine.pooling_config
    assert cfg is not None, "a pooling engine has a pooling config"
    return cfg


def _params(task: str, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
    try:
        return PoolingParams(task=task, dimensions=dimensions, normalize=normalize)
    except ParamError as e:
        raise param_error(e) from None


def _input_error(e: ParamError, where: str) -> APIError:
    """The engine names an input 'input' or 'prompt'; the client knows it as ``where``."""
    return param_error(e, None if e.param in _REQUEST_FIELDS else {e.param: where})


def _window(args: EngineArgs) -> int:
    """How many of one request's inputs may be in the engine at once: what two steps hold,
    less what the waiting queue could not take."""
    seats = args.max_num_seqs * args.data_parallel_size
    waiting = seats if args.max_waiting_requests is None else min(seats, args.max_waiting_requests)
    return seats + waiting


async def _run(
    ctx: ServingContext, request: Request, prefix: str, jobs: list[Job], req: PoolingFields
) -> tuple[str, list[PoolingRequestOutput]]:
    """Every job's output, in order, submitted together (within the window). Raises the
    first failure as an APIError (the other jobs are cancelled), ClientGone if the client
    leaves."""
    if ctx.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
    if req.priority and not ctx.settings.allow_request_priority:
        raise bad_request(
            "'priority' is not enabled on this server (start it with --allow-request-priority)", param="priority"
        )
    engine = ctx.engine
    if sum(len(j.prompt) for j in jobs if isinstance(j.prompt, str)) > _OFFLOAD_CHARS:
        jobs = await asyncio.to_thread(_tokenized, engine, jobs, req.truncate_prompt_tokens)
    timeout = ctx.settings.request_timeout or None
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout  # the request's, whatever its inputs wait
    window = asyncio.Semaphore(_window(cast(_Configured, engine).args))
    rid = ctx.new_id(prefix)

    async def one(i: int, job: Job) -> PoolingRequestOutput:
        sub = rid if len(jobs) == 1 else f"{rid}-{i}"
        last = None
        async with window:
            if ctx.draining:  # the shutdown began while this input waited for the window
                raise APIError(503, "the server is shutting down", code="shutting_down", type="server_error")
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise engine_error(RequestTimeoutError(f"request {rid!r} ran past its timeout of {timeout:g} s"))
            ctx.inflight.add(sub)  # a shutdown's drain waits for it, then aborts it
            try:
                # Run to its end: a cancel lands inside the generator, whose own exit aborts.
                async for out in engine.encode(
                    job.prompt, job.params, sub, req.priority, req.truncate_prompt_tokens, left
                ):
                    last = out
            except ParamError as e:
                raise _input_error(e, job.param) from None
            except (EngineDeadError, RequestError, EngineBusyError) as e:  # a dead or full engine: not a 500
                raise engine_error(e) from None
            finally:
                ctx.inflight.discard(sub)
        if last is None:
            raise APIError(500, "the engine ended a request without output", type="server_error")
        return last

    async def everything() -> list[PoolingRequestOutput]:
        tasks = [asyncio.ensure_future(one(i, job)) for i, job in enumerate(jobs)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed or we were cancelled: the rest leave the engine now
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    ctx.server_load += 1
    try:
        outs = await until_disconnect(request.receive, everything())
    finally:
        ctx.server_load -= 1
    log_extra(
        request,
        engine_request_id=rid,
        prompts=len(jobs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        user=getattr(req, "user", None),
    )
    return rid, outs


def _tokenized(engine: EngineClient, jobs: list[Job], truncate: int | None) -> list[Job]:
    """``jobs`` with their texts as token ids. Many short texts are as much work as one long
    one: a request's are tokenized together, in a thread, where their sum is long (each alone
    would be tokenized on the event loop)."""
    out = []
    for job in jobs:
        if isinstance(job.prompt, str):
            try:
                job = Job(engine.tokenize_pooled(job.prompt, truncate), job.params, job.param)
            except ParamError as e:
                raise _input_error(e, job.param) from None
        out.append(job)
    return out


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[tuple[Prompt, str]]:
    """OpenAI's four input shapes as (prompt, its field) pairs."""
    if isinstance(value, str):
        return [(value, "input")]
    if value and isinstance(value[0], int):
        return [({"prompt_token_ids": value}, "input")]
    return [(v if isinstance(v, str) else {"prompt_token_ids": v}, f"input[{i}]") for i, v in enumerate(value)]


def _usage(outs: Sequence[PoolingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _vector(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64 encoding: the little-endian float32 bytes (what its client decodes)."""
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def _head(ctx: ServingContext, rid: str) -> dict[str, Any]:
    return {"id": rid, "object": "list", "created": int(time.time()), "model": ctx.model_name}


# -- the routes -----------------------------------------------------------------------------------


async def create_embeddings(request: Request) -> Response:
    ctx, req = await _parse(request, EmbeddingRequest)
    params = _params("embed", req.dimensions, req.normalize)
    jobs = [Job(p, params, where) for p, where in _inputs(req.input)]
    rid, outs = await _run(ctx, request, "embd", jobs, req)
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(o.outputs.data, req.encoding_format)}
        for i, o in enumerate(outs)
    ]
    return json_response({**_head(ctx, rid), "data": data, "usage": _usage(outs)})


async def create_pooling(request: Request) -> Response:
    """The model's own pooled output: an embedding, or a classifier's logits."""
    ctx, req = await _parse(request, PoolingRequest)
    classifier = _config(ctx).is_classifier
    params = _params("classify" if classifier else "embed", req.dimensions, req.normalize)
    jobs = [Job(p, params, where) for p, where in _inputs(req.input)]
    rid, outs = await _run(ctx, request, "pool", jobs, req)
    data = [
        {"object": "pooling", "index": i, "data": _vector(o.outputs.data, req.encoding_format)}
        for i, o in enumerate(outs)
    ]
    return json_response({**_head(ctx, rid), "data": data, "usage": _usage(outs)})


async def create_classification(request: Request) -> Response:
    ctx, req = await _parse(request, ClassifyRequest)
    cfg = _config(ctx)
    params = _params("classify")  # an embedding model refuses the task: a 400 naming the model
    jobs = [Job(p, params, where) for p, where in _inputs(req.input)]
    rid, outs = await _run(ctx, request, "classify", jobs, req)
    data = []
    for i, o in enumerate(outs):
        probs = class_probs(o.outputs.data, cfg.class_activation)
        best = max(range(len(probs)), key=probs.__getitem__)
        label = cfg.labels[best] if best < len(cfg.labels) else f"LABEL_{best}"
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return json_response({**_head(ctx, rid), "data": data, "usage": _usage(outs)})


Text = tuple[str, str]  # (the text, the request field it came from)


async def _pair_scores(
    ctx: ServingContext, request: Request, prefix: str, pairs: list[tuple[Text, Text]], req: PoolingFields
) -> tuple[str, list[float], int]:
    """(request id, each pair's score, prompt tokens). A cross-encoder reads each pair as one
    input (its relevance: its one logit through the folder's activation); an embedding model embeds each distinct
    text once and scores the cosine of the two vectors."""
    engine = ctx.engine
    cfg = _config(ctx)
    if cfg.is_classifier:
        if cfg.num_labels != 1:  # before any work: the score of one logit is all that is defined
            raise bad_request(
                f"scoring needs a cross-encoder with one label; '{ctx.model_name}' classifies into "
                f"{cfg.num_labels} (use /classify)",
                param="model",
            )
        params = _params("score")
        truncate = req.truncate_prompt_tokens

        def tokenized() -> list[Job]:
            jobs = []
            for (a, _), (b, where) in pairs:
                try:
                    jobs.append(Job(engine.tokenize_pair(a, b, truncate), params, where))
                except ParamError as e:
                    raise _input_error(e, where) from None
            return jobs

        # the pairs are tokenized together, off the event loop when they are long in all
        chars = sum(len(a) + len(b) for (a, _), (b, _) in pairs)
        jobs = await asyncio.to_thread(tokenized) if chars > _OFFLOAD_CHARS else tokenized()
        rid, outs = await _run(ctx, request, prefix, jobs, req)
        scores = [cross_encoder_score(o.outputs.data, cfg.score_activation) for o in outs]
        return rid, scores, sum(len(o.prompt_token_ids) for o in outs)
    texts: dict[str, str] = {}  # each distinct text once, named by its first field
    for first, second in pairs:
        for text, where in (first, second):
            texts.setdefault(text, where)
    params = _params("embed")
    rid, outs = await _run(ctx, request, prefix, [Job(t, params, w) for t, w in texts.items()], req)
    vectors = {t: o.outputs.data for t, o in zip(texts, outs)}
    scores = [cosine(vectors[a], vectors[b]) for (a, _), (b, _) in pairs]
    return rid, scores, sum(len(o.prompt_token_ids) for o in outs)


def _named(value: str | list[str], field: str) -> list[Text]:
    if isinstance(value, str):
        return [(value, field)]
    return [(t, f"{field}[{i}]") for i, t in enumerate(value)]


async def create_score(request: Request) -> Response:
    ctx, req = await _parse(request, ScoreRequest)
    firsts, seconds = _named(req.text_1, "text_1"), _named(req.text_2, "text_2")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise bad_request(
            f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one text_1 (scored against "
            "every text_2) or as many as text_2 (scored in pairs)",
            param="text_1",
        )
    pairs = [(firsts[0] if len(firsts) == 1 else firsts[i], s) for i, s in enumerate(seconds)]
    rid, scores, tokens = await _pair_scores(ctx, request, "score", pairs, req)
    data = [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_response({**_head(ctx, rid), "data": data, "usage": usage})


async def create_rerank(request: Request) -> Response:
    ctx, req = await _parse(request, RerankRequest)
    query = (req.query, "query")
    pairs = [(query, doc) for doc in _named(req.documents, "documents")]
    rid, scores, tokens = await _pair_scores(ctx, request, "rerank", pairs, req)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep the request's order
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    return json_response({"id": rid, "model": ctx.model_name, "usage": {"total_tokens": tokens}, "results": results})
