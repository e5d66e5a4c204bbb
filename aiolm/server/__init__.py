"""The OpenAI-compatible HTTP server (Starlette ASGI app).

``build_app(engine)`` embeds a running or not-yet-started engine; ``create_app()``
is the factory ASGI servers call (settings from AIOLM_* environment variables).
"""

from aiolm.server.app import build_app, create_app

__all__ = ["build_app", "create_app"]
