"""The chat page at ``/``: static files from ``aiolm/server/web``, no build step, no CDN.

The page is plain HTML, CSS and JS modules that talk to this server's own
``/v1/*`` API with the key the user types (kept in sessionStorage at most), so
the page itself is served without a key (``AuthMiddleware`` leaves ``/`` and
``/web/`` open). Its Content-Security-Policy allows only same-origin scripts,
styles and connections: a rendered answer can never load or run anything else.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

WEB_DIR = Path(__file__).with_name("web")
PREFIX = "/web"
_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


async def index(request: Request) -> Response:
    return FileResponse(WEB_DIR / "index.html", headers=_HEADERS, media_type="text/html; charset=utf-8")


class _WithPageHeaders:
    """The page's headers on every file under ``/web/`` too: ``/web/index.html`` is the same
    working page (it needs the same CSP and framing rule), and the scripts need no-cache,
    or a browser runs last version's modules against this version's page after an upgrade."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_RAW_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


_RAW_HEADERS = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in _HEADERS.items()]


def web_routes() -> list[BaseRoute]:
    """``GET /`` (the page) and ``/web/*`` (its scripts and styles)."""
    files = _WithPageHeaders(StaticFiles(directory=WEB_DIR))
    return [Route("/", index, methods=["GET"]), Mount(PREFIX, files, name="web")]
