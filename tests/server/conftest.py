"""The fixtures every server test module may ask for by name (pytest finds them here)."""

from __future__ import annotations

import pytest
from server_helpers import FakeEngine, ServerProcess, SharedServer


@pytest.fixture(scope="module")
def server(keyed_servers: SharedServer) -> ServerProcess:
    """The shared real `aiolm serve` with an API key and vLLM's metric names."""
    return keyed_servers.get()


@pytest.fixture
def fake_engine() -> FakeEngine:
    """An engine surface without a model, for the server's own logic."""
    return FakeEngine()
