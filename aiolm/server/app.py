"""The ASGI app: ``build_app(engine)`` for embedding, ``create_app()`` for ASGI servers.

    uvicorn --factory aiolm.server:create_app          # settings from AIOLM_* variables
    hypercorn 'aiolm.server:create_app()'
    granian --interface asgi --factory aiolm.server:create_app

The engine starts and stops with the ASGI lifespan; at shutdown in-flight
requests get ``shutdown_timeout`` seconds to finish, the rest are aborted, and
``engine.shutdown()`` stops the workers and unlinks their shared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aiolm.engine.client import EngineClient
from aiolm.server import anthropic_messages, chat, completions, invocations, misc, pooling, responses
from aiolm.server.anthropic_errors import error_response
from aiolm.server.context import ServingContext
from aiolm.server.errors import APIError, json_response
from aiolm.server.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    BodyTimeoutMiddleware,
    InternalErrorMiddleware,
    RequestContextMiddleware,
    StartupFailureMiddleware,
)
from aiolm.server.openapi import openapi_schema
from aiolm.server.settings import ServerSettings, from_environment
from aiolm.server.sse import ClientGone
from aiolm.server.webui import web_routes

log = logging.getLogger("aiolm.server")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    messages = {
        404: f"no route for {request.method} {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    msg = messages.get(exc.status_code, str(exc.detail))
    codes = {404: "not_found", 405: "method_not_allowed"}
    err = APIError(exc.status_code, msg, code=codes.get(exc.status_code), headers=dict(exc.headers or {}))
    return error_response(request.url.path, err)


async def _client_gone(request: Request, exc: Exception) -> Response:
    # Nobody is listening; the status is for the access log (nginx's "client closed request").
    return Response(status_code=499)


def _routes(settings: ServerSettings) -> list[BaseRoute]:
    async def openapi(request: Request) -> Response:
        ctx: ServingContext = request.app.state.ctx
        return json_response(openapi_schema(ctx.settings.limits, ctx.model_name, ctx.settings.web_ui))

    # Every server has every route; one of the other runner answers a 400 naming the model.
    generate = {
        "/v1/chat/completions": chat.create_chat_completion,
        "/v1/completions": completions.create_completion,
        "/v1/responses": responses.create_response,
        "/v1/messages": anthropic_messages.create_message,  # Anthropic's Messages API
        "/v1/messages/count_tokens": anthropic_messages.count_tokens,
    }
    pool = {
        "/v1/embeddings": pooling.create_embeddings,
        "/pooling": pooling.create_pooling,
        "/score": pooling.create_score,
        "/v1/score": pooling.create_score,
        "/rerank": pooling.create_rerank,
        "/v1/rerank": pooling.create_rerank,
        "/v2/rerank": pooling.create_rerank,
        "/classify": pooling.create_classification,
    }
    handlers = {
        **{path: pooling.only_for("generate", f) for path, f in generate.items()},
        **{path: pooling.only_for("pooling", f) for path, f in pool.items()},
    }
    return [
        *(Route(path, f, methods=["POST"]) for path, f in handlers.items()),
        Route("/invocations", invocations.endpoint(handlers), methods=["POST"]),
        Route("/v1/models", misc.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", misc.get_model, methods=["GET"]),
        Route("/v1/load_lora_adapter", misc.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", misc.unload_lora_adapter, methods=["POST"]),
        Route("/health", misc.health, methods=["GET"]),
        Route("/ping", misc.health, methods=["GET", "POST"]),  # SageMaker's health check is a POST
        Route("/version", misc.version, methods=["GET"]),
        Route("/tokenize", misc.tokenize, methods=["POST"]),
        Route("/detokenize", misc.detokenize, methods=["POST"]),
        Route("/tokenizer_info", misc.tokenizer_info, methods=["GET"]),
        Route("/load", misc.load, methods=["GET"]),
        Route("/metrics", misc.metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *(web_routes() if settings.web_ui else []),
    ]


def build_app(engine: EngineClient, settings: ServerSettings | None = None, manage_engine: bool = True) -> Starlette:
    """An OpenAI-compatible Starlette app serving ``engine`` (an AsyncEngine or a DataParallelEngine).

    With ``manage_engine`` the ASGI lifespan starts the engine and shuts it down;
    without it the caller owns the engine's life cycle.
    """
    settings = settings or ServerSettings()
    ctx = ServingContext(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            # A task of its own: a stop asked for meanwhile cancels the start (ctx.stop_starting),
            # and the server goes on to a clean shutdown of what little started.
            starting = ctx.starting = asyncio.ensure_future(engine.start())
            try:
                await asyncio.wait({starting})
            except BaseException:  # we were cancelled ourselves
                starting.cancel()
                raise
            finally:
                ctx.starting = None
            if starting.cancelled():
                log.info("stopped while the engine started")
                try:
                    yield
                finally:
                    await engine.shutdown()
                return
            try:
                starting.result()
            except Exception as e:  # mostly the user's to fix: too little KV cache, a broken tokenizer
                log.debug("the engine did not start", exc_info=True)
                ctx.start_error = f"the engine did not start: {e}"
                raise
        if settings.exit_on_engine_death:
            engine.death_callbacks.append(lambda reason: _exit_on_death(ctx, reason))
        log.info("serving %s (max_model_len %s)", ctx.model_name, getattr(engine, "max_model_len", "?"))
        defaults = getattr(engine, "sampling_defaults", None)
        if defaults:
            log.info(
                "sampling defaults from the model's generation_config.json: %s (--generation-config vllm: none)",
                defaults,
            )
        try:
            yield
        finally:
            await ctx.drain(settings.shutdown_timeout)
            if manage_engine:
                await engine.shutdown()
            log.info("engine shut down")

    middleware = [
        Middleware(StartupFailureMiddleware, reason=lambda: ctx.start_error),
        Middleware(RequestContextMiddleware, access_log_enabled=settings.access_log),
        Middleware(InternalErrorMiddleware),
    ]
    if settings.allowed_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=settings.allowed_origins,
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["x-request-id"],
            )
        )
    middleware.append(Middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes))
    middleware.append(Middleware(BodyTimeoutMiddleware, timeout=settings.body_timeout))
    if settings.api_key:
        middleware.append(Middleware(AuthMiddleware, api_key=settings.api_key))
    handlers: dict[Any, Any] = {
        APIError: _api_error,
        HTTPException: _http_error,
        ClientGone: _client_gone,
        ClientDisconnect: _client_gone,
    }
    app = Starlette(routes=_routes(settings), middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
    app.state.ctx = ctx
    return app


def _exit_on_death(ctx: ServingContext, reason: str) -> None:
    """The engine cannot serve again: stop the server the way SIGTERM does (streams have
    already failed), so a process supervisor starts a fresh one; `aiolm serve` exits 1."""
    ctx.engine_died = reason
    log.critical("the engine is dead (%s); stopping the server", reason)
    os.kill(os.getpid(), signal.SIGTERM)


def create_app() -> Starlette:
    """App factory for ASGI servers: engine and server settings from AIOLM_* variables.
    A model or flags that cannot work exit with one line, before anything starts."""
    from aiolm.engine.async_engine import check_model_args
    from aiolm.engine.data_parallel import create_engine

    engine_args, settings = from_environment()
    try:
        check_model_args(engine_args)
    except ValueError as e:  # ModelLoadError is one
        raise SystemExit(f"create_app: {e}") from None
    _default_logging()
    if settings.access_log:
        # uvicorn would log every request a second time; ours has the request id and timings.
        logging.getLogger("uvicorn.access").disabled = True
    return build_app(create_engine(engine_args), settings)


def _default_logging() -> None:
    """Under a foreign ASGI server nobody configures our loggers; without this the
    access log and engine errors would vanish. Leaves any existing setup alone."""
    pkg = logging.getLogger("aiolm")
    if pkg.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)
