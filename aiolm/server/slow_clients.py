"""`aiolm serve`'s guard against clients that hold connections without sending requests.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but not one that
is sending a request's headers: a client that opens a connection and trickles, or
stops, partway through its headers holds a socket and a file descriptor for as long
as it likes, and a few thousand of them exhaust the process's descriptors. The guard
is a subclass of the HTTP protocol class uvicorn would pick (h11 or httptools) that

- closes a connection whose request headers are not complete ``header_timeout``
  seconds after its first byte (the connection's opening, or the first byte of the
  next request on a kept-alive connection), and
- closes at once a new connection beyond ``max_connections`` open ones.

Both protocol classes create a new ``cycle`` (uvicorn's request-response state) when a
request's headers are complete; that is the one hook the guard relies on, and
tests/server/test_slow_clients.py runs it against real sockets. The request body has
its own limit (``--body-timeout``, middleware.py), and ASGI servers other than
``aiolm serve`` bring their own settings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("aiolm.server")

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 2048


def add_args(parser: argparse.ArgumentParser, seconds: Any, count: Any) -> None:
    """The flags of `aiolm serve` (``seconds`` and ``count`` are the argparse types to use)."""
    g = parser.add_argument_group("connections")
    g.add_argument(
        "--header-timeout",
        type=seconds,
        default=HEADER_TIMEOUT_S,
        help="seconds a client may take to send a request's headers, from its first byte; "
        "the connection is closed after (0 = no limit)",
    )
    g.add_argument(
        "--max-connections",
        type=count,
        default=MAX_CONNECTIONS,
        help="most open client connections; one more is closed as soon as it opens",
    )


_OWN_FILES = 512  # what the server holds besides connections: pipes, shared memory, model files


def connections_allowed(max_connections: int) -> int:
    """The connection cap the process's open-file limit can hold. Its soft limit is raised
    (up to the hard one) to fit ``max_connections`` and the server's own files; where even
    that cannot, the cap is lowered to fit, with a warning. Past the limit, accept() fails
    and a new client is reset with nothing logged; under the cap, the guard closes it and says so."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _OWN_FILES
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections
    raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    except (ValueError, OSError) as e:
        log.debug("raising the open-file limit to %d failed: %s", raised, e)
    if soft >= want:
        return max_connections
    cap = max(soft // 2, soft - _OWN_FILES)  # a small limit still leaves half for connections
    log.warning(
        "--max-connections %d needs %d open files, and this process may open %d (ulimit -n); "
        "at most %d connections are taken",
        max_connections,
        want,
        soft,
        cap,
    )
    return cap


def guarded(base: type, header_timeout: float, max_connections: int) -> type:
    """``base`` (uvicorn's HTTP protocol class) with the header timeout and connection cap."""

    class Guarded(base):
        _header_timer: asyncio.TimerHandle | None = None
        _cycle_when_armed: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _refused.say(len(self.connections) - 1)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._cycle_when_armed:  # a request's headers are complete
                self._disarm()
            if (
                self._header_timer is None
                and (self.cycle is None or self.cycle.response_complete)
                and not self.transport.is_closing()
            ):
                self._arm()  # the first bytes of a kept-alive connection's next request

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if header_timeout > 0:
                self._cycle_when_armed = self.cycle
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is self._cycle_when_armed and not self.transport.is_closing():
                self.transport.close()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


class _RateLimitedWarning:
    """One warning per minute at most: a flood of refused connections must not flood the log."""

    def __init__(self) -> None:
        self._last = -float("inf")

    def say(self, open_now: int) -> None:
        now = time.monotonic()
        if now - self._last >= 60.0:
            self._last = now
            log.warning("refusing connections: %d are open (--max-connections)", open_now)


_refused = _RateLimitedWarning()
