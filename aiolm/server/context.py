"""What every route needs: the engine, the settings, the live requests."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from aiolm.engine.client import EngineClient
from aiolm.server.settings import ServerSettings

log = logging.getLogger("aiolm.server")


class ServingContext:
    def __init__(self, engine: EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.created = int(time.time())
        self.inflight: set[str] = set()  # engine request ids being served right now
        self.server_load = 0  # model HTTP requests (generation or pooling) being served right now (vLLM's GET /load)
        self.draining = False
        self.engine_died: str | None = None  # set when the engine died and the server is stopping
        self.start_error: str | None = None  # why the engine did not start, in one line
        self.starting: asyncio.Future[None] | None = None  # the engine's start, while it runs (app.py)

    def stop_starting(self) -> None:
        """Give up the engine's start (the server was told to stop while the model loads)."""
        if self.starting is not None:
            self.starting.cancel()

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine, "model_name", None) or "aiolm")  # known once started

    def new_id(self, prefix: str, sep: str = "-") -> str:
        return f"{prefix}{sep}{uuid.uuid4().hex}"

    async def drain(self, timeout: float) -> None:
        """Let in-flight generations finish for up to ``timeout`` s, then abort the rest."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("aborting %d request(s) still running at shutdown", len(self.inflight))
            for rid in list(self.inflight):
                await self.engine.abort(rid)
