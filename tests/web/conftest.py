"""Fixtures for the chat page tests: headless Chromium driven by Playwright, and real servers.

Chromium comes from the system (Debian's ``chromium`` package, or ``AIOLM_CHROMIUM``);
Playwright never downloads a browser here. Where none can be found or launched the
browser tests skip and say why (in CI, an installed Chromium that fails to launch fails
them). Screenshots go to ``AIOLM_TEST_ARTIFACTS`` (``.ci/run`` sets ``artifacts/``; default:
a pytest temporary folder).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The server tests' helpers (a real server subprocess, the fake engine), imported the way
# tests/server's own modules import them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import ServerProcess, SharedServer  # noqa: E402


def chromium_executable() -> str | None:
    given = os.environ.get("AIOLM_CHROMIUM")
    if given:
        return given if Path(given).exists() else shutil.which(given)
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


# Module scope, not session: the sync Playwright API keeps an event loop running in this
# thread while it is open, and later tests that call asyncio.run() must not see it.
@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the 'test' extra)")
    exe = chromium_executable()
    if exe is None:
        pytest.skip("no Chromium executable found: apt-get install chromium, or set AIOLM_CHROMIUM")
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=exe)
        except sync_api.Error as e:
            # In CI (.ci/run installed it) an installed Chromium that cannot start is a failure,
            # not a reason to skip the page's tests.
            if os.environ.get("CI"):
                pytest.fail(f"Chromium at {exe} could not be launched: {e}")
            pytest.skip(f"Chromium at {exe} could not be launched: {e}")
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("AIOLM_TEST_ARTIFACTS")
    path = Path(given) if given else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def chat_server(open_servers: SharedServer) -> ServerProcess:
    """A real `aiolm serve` without a key (shared, tests/conftest.py)."""
    return open_servers.get()


@pytest.fixture(scope="module")
def keyed_server(keyed_servers: SharedServer) -> ServerProcess:
    """A real `aiolm serve --api-key API_KEY` (shared, tests/conftest.py)."""
    return keyed_servers.get()
