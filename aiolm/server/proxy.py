"""``aiolm proxy``: prefill/decode disaggregation behind one OpenAI-compatible address.

Each completion or chat request goes first to a prefill instance (round robin) as the
same request with ``max_tokens`` 1, no stream and ``kv_transfer_params``
``{"do_remote_decode": true}``: it computes the prompt and keeps its KV for a decode
instance. Its answer's ``kv_transfer_params`` say where that KV is; the request then
goes, as the client sent it plus those params, to a decode instance (round robin),
whose answer (a stream or not) goes back to the client unchanged. The instances are
aiolm (or vLLM) servers started with ``--kv-transfer-config``: the prefill ones as
``kv_producer``, the decode ones as ``kv_consumer``.

A prefill instance that fails or answers without params leaves the decode instance to
compute the prompt itself (the answer is the same, only slower); an error from the
decode instance is the client's answer, its headers (``retry-after``, ``x-request-id``)
with it, and a decode instance that cannot be reached or breaks off is a 502 (or,
mid-stream, an error event and ``[DONE]`` after the last whole event). A batch of
prompts goes to the decode instance alone: a prefill answer carries one prompt's params.
A client that leaves is left by the proxy too, so the instances abort the request.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aiolm.server.errors import APIError, bad_request
from aiolm.server.sse import DONE, ClientGone, sse_event, until_disconnect

log = logging.getLogger(__name__)

# What the prefill instance must not get from the client's request: it answers one token,
# unstreamed (stream options are refused without a stream; min_tokens above 1 with one token).
_PREFILL_DROPS = ("stream_options", "min_tokens", "max_completion_tokens")
_FORWARDED_HEADERS = ("authorization", "x-request-id")
# What an instance's answer keeps of its headers: all but the hop-by-hop ones and those the
# proxy's own response sets (the body is relayed decoded, its length may differ).
_ANSWER_DROPS = frozenset(
    ("connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate")
    + ("content-length", "content-encoding", "content-type", "date", "server")
)


def build_proxy_app(prefill: Sequence[str], decode: Sequence[str], timeout: float = 600.0) -> Starlette:
    """The proxy's ASGI app over the given instances' base URLs (``http://host:port``)."""
    if not prefill or not decode:
        raise ValueError("aiolm proxy needs at least one --prefill and one --decode instance")
    prefill_next = itertools.cycle([u.rstrip("/") for u in prefill]).__next__
    decode_urls = [u.rstrip("/") for u in decode]
    decode_next = itertools.cycle(decode_urls).__next__
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    async def disaggregated(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return bad_request("the body is not JSON").response()
        if not isinstance(body, dict):
            return bad_request("the body must be a JSON object").response()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        try:
            return await until_disconnect(request.receive, _answer(request.url.path, body, headers))
        except ClientGone:  # its requests were cancelled: the instances saw their clients go too
            return Response(status_code=499)

    async def _answer(path: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        params = await _prefill(client, prefill_next(), path, body, headers) if not _batch(body) else None
        decode_body = dict(body, kv_transfer_params=params) if params is not None else body
        base = decode_next()
        try:
            if body.get("stream"):
                return await _stream(client, base, path, decode_body, headers)
            resp = await client.post(base + path, json=decode_body, headers=headers)
        except httpx.HTTPError as e:
            return _unreachable(base, e).response()
        return _relayed(resp, resp.content)

    async def models(request: Request) -> Response:
        base = decode_next()
        try:
            resp = await client.get(base + "/v1/models")
        except httpx.HTTPError as e:
            return _unreachable(base, e).response()
        return _relayed(resp, resp.content)

    async def health(request: Request) -> Response:
        """Healthy while some decode instance is (prefill ones are optional: their loss
        costs speed, not answers)."""
        for base in decode_urls:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(base + "/health", timeout=5.0)).status_code == 200:
                    return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": "no decode instance is healthy"}, status_code=503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(
        routes=[
            Route("/v1/completions", disaggregated, methods=["POST"]),
            Route("/v1/chat/completions", disaggregated, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


async def _prefill(
    client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any] | None:
    """The prefill instance's kv_transfer_params for ``body``, or None (it failed)."""
    ask = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    ask.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    try:
        resp = await client.post(base + path, json=ask, headers=headers)
        params = resp.json().get("kv_transfer_params") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        log.warning("prefill instance %s failed: %s; the decode instance computes the prompt", base, e)
        return None
    if params is None:
        log.warning("prefill instance %s answered %d without kv_transfer_params", base, resp.status_code)
    return params


def _batch(body: dict[str, Any]) -> bool:
    """A completions request with several prompts (strings or token lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _event_end(data: bytearray, start: int, separator: bytes) -> int:
    """Where the last whole event in ``data`` ends (0: none), looking from ``start``."""
    at = data.rfind(separator, start)
    return at + len(separator) if at >= 0 else 0


def _with_answer_headers(response: Response, resp: httpx.Response) -> Response:
    """``response`` with the instance's headers, each repeated one kept (set-cookie)."""
    response.raw_headers.extend(
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in resp.headers.multi_items()
        if k.lower() not in _ANSWER_DROPS
    )
    return response


def _relayed(resp: httpx.Response, content: bytes) -> Response:
    """An instance's whole answer as the proxy's: status, body and headers."""
    return _with_answer_headers(Response(content, resp.status_code, media_type=resp.headers.get("content-type")), resp)


def _unreachable(base: str, error: Exception) -> APIError:
    """A decode instance that cannot be reached, or broke off its answer."""
    why = str(error) or type(error).__name__
    return APIError(502, f"the decode instance {base} failed: {why}", code="bad_gateway", type="server_error")


async def _stream(
    client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> Response:
    req = client.build_request("POST", base + path, json=body, headers=headers)
    resp = await client.send(req, stream=True)
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        return _relayed(resp, content)

    async def relay() -> AsyncIterator[bytes]:
        held = bytearray()  # the part of an event not ended yet: whole events only go out
        try:
            async for chunk in resp.aiter_bytes():
                # only the new bytes (and the 3 before them) can hold an event's end: a big
                # event in many chunks is scanned once, not once a chunk
                start = max(0, len(held) - 3)
                held += chunk
                end = max(_event_end(held, start, b"\n\n"), _event_end(held, start, b"\r\n\r\n"))
                if end:
                    yield bytes(held[:end])
                    del held[:end]
            if held:
                yield bytes(held)  # the instance ended its answer there: relayed as it is
        except httpx.HTTPError as e:  # the instance died mid-answer: say so in the stream, and end it
            # its half event is dropped: a client would parse it as a whole one, and fail
            log.warning("decode instance %s broke off a stream: %s", base, e)
            yield sse_event(_unreachable(base, e).body()) + DONE
        finally:
            await resp.aclose()

    media = resp.headers.get("content-type", "text/event-stream")
    return _with_answer_headers(StreamingResponse(relay(), media_type=media), resp)


def parse_args(argv: list[str]) -> Any:
    from aiolm.config import CliParser, int_in, positive

    p = CliParser(prog="aiolm proxy", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--prefill", nargs="+", type=_base_url, required=True, help="base URLs of prefill (kv_producer) instances"
    )
    p.add_argument(
        "--decode", nargs="+", type=_base_url, required=True, help="base URLs of decode (kv_consumer) instances"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_in(1, 65535), default=8000, help="port to listen on")
    p.add_argument("--timeout", type=positive, default=600.0, help="seconds an instance may take to answer")
    return p.parse_args(argv)


def _base_url(text: str) -> str:
    """An instance's base URL, http(s)://host[:port]; an argparse type (a bare name was taken,
    and every request then failed with a 502)."""
    import argparse
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a base URL like http://127.0.0.1:8100")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text
