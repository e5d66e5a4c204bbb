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


def web_routes() -> list[BaseRoute]:
    """``GET /`` (the page) and ``/web/*`` (its scripts and styles)."""
    return [Route("/", index, methods=["GET"]), Mount(PREFIX, StaticFiles(directory=WEB_DIR), name="web")]
