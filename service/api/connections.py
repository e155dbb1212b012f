"""uvicorn's HTTP/1.1 protocol with what it lacks against idle connections.

uvicorn bounds neither the time a connection may take to send its request line and
headers nor the number of connections open at once: 200 sockets that sent nothing
stayed open (none closed after 75 s), and 1,100 of them under the common 1,024
open-file limit made ``/healthz`` unreachable, with nothing logged (issue 31). An ASGI
middleware cannot help: the app first hears of a request once its headers are
complete. So this subclass of uvicorn's h11 protocol adds, per connection:

- a header deadline (``OPTIREMAT_HEADER_TIMEOUT_S``, as nginx's
  ``client_header_timeout``): from the connection's opening, or from the first byte of
  a later request on it, the request line and headers must be complete in time, else
  the connection is closed, with a ``408`` if part of a request had arrived;
- the idle keep-alive deadline is uvicorn's own ``timeout_keep_alive``
  (``OPTIREMAT_KEEP_ALIVE_TIMEOUT_S``);
- a connection limit (``OPTIREMAT_MAX_CONNECTIONS``): past it the connection that has
  waited longest for a request is closed to make room, so idle sockets cannot lock
  clients out (the one closed is always a waiting one, so the connections open stay
  within one of the limit); when every connection has a request in flight the new
  one's requests are answered ``503`` with ``Retry-After`` (``/healthz`` and
  ``/readyz`` still answer). Either is logged, at most once in ``_LOG_EVERY_S``.

It also answers uvicorn's own ``400`` (a malformed request line or header) as
``application/problem+json`` like every other error of the service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from optiremat.service.api.problems import PROBLEM_MEDIA_TYPE, problem_body
from optiremat.service.core.config import Settings
from optiremat.service.core.metrics import Metrics
from optiremat.solver.wire import INVALID_REQUEST

log = logging.getLogger("optiremat.service")

_LOG_EVERY_S = 10.0
_PROBES = ("/healthz", "/readyz")


def _raw_response(status: int, reason: str, title: str, detail: str,
                  headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 response with a problem body, for a connection that has no
    request h11 could answer."""
    body = json.dumps(problem_body(status, title, detail, type=INVALID_REQUEST.uri)).encode()
    lines = [f"HTTP/1.1 {status} {reason}", f"content-type: {PROBLEM_MEDIA_TYPE}",
             f"content-length: {len(body)}", "connection: close",
             *(f"{name}: {value}" for name, value in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _LimitLog:
    """One log line per ``_LOG_EVERY_S`` while the connection limit bites."""

    def __init__(self) -> None:
        self.closed_idle = self.refused = 0
        self.last_s = -_LOG_EVERY_S

    def record(self, *, refused: bool, limit: int) -> None:
        if refused:
            self.refused += 1
        else:
            self.closed_idle += 1
        now = time.monotonic()
        if now - self.last_s < _LOG_EVERY_S:
            return
        log.warning("connection limit reached: closed the longest-idle connections or "
                    "refused new ones (OPTIREMAT_MAX_CONNECTIONS)",
                    extra={"max_connections": limit, "closed_idle": self.closed_idle,
                           "refused": self.refused})
        self.last_s, self.closed_idle, self.refused = now, 0, 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection limit."""

    header_timeout_s: ClassVar[float]
    max_connections: ClassVar[int]
    limit_log: ClassVar[_LimitLog]
    metrics: ClassVar[Metrics]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None  # no request in flight since then
        self._partial = False  # part of a request line or headers has arrived

    # ---- the connection limit ----------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting_since = time.monotonic()
        self.metrics.open_connections.set(len(self.connections))
        if len(self.connections) > self.max_connections:
            idle = self._longest_idle()
            self.limit_log.record(refused=idle is None, limit=self.max_connections)
            self.metrics.connections_turned_away.labels(
                reason="over_limit" if idle is None else "longest_idle").inc()
            if idle is None:
                self._over_limit()
            else:
                idle.transport.close()
        self._arm_header_deadline()

    def _longest_idle(self) -> GuardedH11Protocol | None:
        idle = [c for c in self.connections
                if isinstance(c, GuardedH11Protocol) and c is not self
                and c._waiting_since is not None and not c.transport.is_closing()]
        return min(idle, key=lambda c: c._waiting_since or 0.0, default=None)

    def _over_limit(self) -> None:
        """Every connection has a request in flight: this one's requests are answered 503,
        but for the probes, which an orchestrator must keep hearing."""
        app = self.app

        async def refuse_all_but_probes(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] in _PROBES:
                await app(scope, receive, send)
                return
            body = json.dumps(problem_body(
                503, "Too many connections",
                f"the server has {self.max_connections} connections open, each with a request "
                "in flight (OPTIREMAT_MAX_CONNECTIONS); retry shortly",
                instance=scope.get("path"))).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})

        self.app = refuse_all_but_probes

    # ---- the header deadline -----------------------------------------------

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s,
                                                         self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.metrics.connections_turned_away.labels(reason="header_timeout").inc()
        if self._partial:  # a client that started a request hears why it ends
            self.transport.write(_raw_response(
                408, "Request Timeout", "Request timeout",
                f"the request line and headers did not arrive within "
                f"{self.header_timeout_s:g} s (OPTIREMAT_HEADER_TIMEOUT_S)"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._partial = True
            self._arm_header_deadline()  # from the first byte of a later request

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers are complete
            self._disarm_header_deadline()
            self._waiting_since, self._partial = None, False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # waiting for the next request
            self._waiting_since = self._waiting_since or time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._waiting_since = None
        super().connection_lost(exc)
        self.metrics.open_connections.set(len(self.connections))

    # ---- protocol errors as problems ---------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request h11 cannot parse, as problem+json."""
        self.transport.write(_raw_response(
            400, "Bad Request", "Malformed HTTP request",
            f"the request line or headers are not valid HTTP/1.1: {msg}"))
        self.transport.close()


def guarded_protocol(settings: Settings, metrics: Metrics) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these settings, counting
    in ``metrics``."""
    return type("OptirematH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": settings.header_timeout_s,
        "max_connections": settings.max_connections,
        "limit_log": _LimitLog(),
        "metrics": metrics,
    })
