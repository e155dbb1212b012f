"""ASGI middleware: request ids, one log line and a latency sample per request, body decoding.

Both are plain ASGI (not ``BaseHTTPMiddleware``) so they add no task per request
and can answer before the app runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from optiremat.service.api.caps import check_counts
from optiremat.service.api.problems import HTTPProblem, problem_body
from optiremat.service.core.config import Settings
from optiremat.service.core.memory import LARGE_BODY_BYTES, MemoryReleaser
from optiremat.service.core.metrics import Metrics
from optiremat.solver.wire import INVALID_REQUEST

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_log = logging.getLogger("optiremat.access")
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


_FAILURE_BYTES = 2000


def _detail(body: bytes) -> str:
    """A problem body's ``detail``, else the start of the body as text."""
    try:
        return str(json.loads(body)["detail"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() != "0"
    return _header(scope, b"transfer-encoding") is not None


class RequestContextMiddleware:
    """Gives each request an id (``X-Request-ID``), logs it on one line, times it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        offered = _header(scope, b"x-request-id")
        request_id = offered if offered and _CLIENT_REQUEST_ID.match(offered) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500  # what the client sees if the app raises before responding
        started = time.perf_counter()
        failure = b""  # the start of a 5xx body: what went wrong, for the error line

        async def send_with_id(message: Message) -> None:
            nonlocal status, failure
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
            elif status >= 500 and len(failure) < _FAILURE_BYTES:
                failure += message.get("body", b"")[:_FAILURE_BYTES - len(failure)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            route = scope.get("route")
            # the route template, not the raw path: job ids must not explode label cardinality
            template = getattr(route, "path", "unmatched")
            self.metrics.request_seconds.labels(
                method=scope["method"], route=template, status=str(status)
            ).observe(seconds)
            client = scope.get("client")
            extra = {"detail": _detail(failure)} if status >= 500 else {}
            # A 5xx is the server's fault: an error line an operator's alert can match.
            # But /readyz's 503 is its answer (starting, stopping, the store away), which
            # the orchestrator acts on; start-up alone logged a few errors.
            fault = status >= 500 and template != "/readyz"
            access_log.log(
                logging.ERROR if fault else logging.INFO,
                "%s %s %d", scope["method"], scope["path"], status,
                extra={
                    **extra,
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "route": template,
                    "status": status,
                    "duration_ms": round(seconds * 1000, 3),
                    "client": f"{client[0]}:{client[1]}" if client else None,
                },
            )


class _Reject(Exception):
    def __init__(self, status: int, title: str, detail: str,
                 headers: list[tuple[bytes, bytes]] | None = None, *,
                 type: str = INVALID_REQUEST.uri) -> None:
        self.status, self.title, self.detail, self.type = status, title, detail, type
        self.headers = headers or []


def _too_large(limit: int) -> _Reject:
    return _Reject(413, "Body too large",
                   f"the request body exceeds {limit} bytes (OPTIREMAT_MAX_BODY_BYTES)")


class _Gunzip:
    """Inflates a gzip body chunk by chunk, never more than one byte past ``limit``
    (a small gzip bomb is refused as soon as its output passes it), member after
    member."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self._member = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)

    def inflate(self, chunk: bytes, into: list[bytes]) -> None:
        try:
            while chunk:
                piece = self._member.decompress(chunk, self.limit - self.size + 1)
                self.size += len(piece)
                into.append(piece)
                if self.size > self.limit:
                    raise _Reject(413, "Body too large",
                                  f"the gzip body inflates past {self.limit} bytes "
                                  "(OPTIREMAT_MAX_BODY_BYTES)")
                chunk = self._member.unconsumed_tail
                if self._member.eof and self._member.unused_data:  # another member follows
                    chunk = self._member.unused_data
                    self._member = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        except zlib.error as exc:
            raise _Reject(400, "Malformed gzip", f"the body is not valid gzip: {exc}") from exc

    def finish(self) -> None:
        if not self._member.eof:
            raise _Reject(400, "Malformed gzip", "the gzip body is truncated")


class BodyDecodingMiddleware:
    """Admits JSON bodies only, caps their size, decodes ``Content-Encoding: gzip``
    under the same cap, and refuses a graph over the caps (``caps.check_counts``).

    The size cap applies to the decoded bytes, so a small gzip bomb is refused as
    soon as its output passes the limit, without inflating the rest. The graph caps
    are checked here, on the body as it has arrived, so that a graph over them costs
    no more than its bytes: no authentication, no hash, no parse.
    """

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.releaser = MemoryReleaser()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)  # routing answers 405s and missing bodies
            return
        try:
            # A client that announces a body and sends it slowly, or not at all, would
            # hold its connection and the body read so far for as long as it likes.
            async with asyncio.timeout(self.settings.body_timeout_s):
                body = await self._read(scope, receive)
        except TimeoutError:
            await self._send_problem(scope, send, _Reject(
                408, "Request timeout",
                f"the request body did not arrive within {self.settings.body_timeout_s:g} s "
                "(OPTIREMAT_BODY_TIMEOUT_S)", headers=[(b"connection", b"close")]))
            return
        except _Reject as reject:
            await self._send_problem(scope, send, reject)
            return

        headers = [(k, v) for k, v in scope["headers"]
                   if k.lower() not in (b"content-encoding", b"content-length")]
        headers.append((b"content-length", str(len(body)).encode()))
        scope["headers"] = headers
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect

        large = len(body) >= LARGE_BODY_BYTES
        if large:
            self.releaser.begin()
        try:
            if await self._over_the_caps(scope, send, body, large):
                return
            await self.app(scope, replay, send)
        finally:
            if large:
                await self.releaser.end()

    async def _over_the_caps(self, scope: Scope, send: Send, body: bytes,
                             large: bool) -> bool:
        """Refuse (413) a graph over the caps; whether it did."""
        try:
            if large:  # milliseconds, or tens of them for columns of strings: off the loop
                await asyncio.to_thread(check_counts, body, self.settings)
            else:
                check_counts(body, self.settings)
        except HTTPProblem as problem:
            await self._send_problem(scope, send, _Reject(
                problem.status, problem.title, problem.detail, type=problem.type))
            return True
        return False

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        gunzip = _Gunzip(limit) if self._admitted_encoding(scope) != "identity" else None
        raw_size = 0
        parts: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Reject(400, "Incomplete body", "the client disconnected mid-body")
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            raw_size += len(chunk)
            if raw_size > limit:
                raise _too_large(limit)
            if gunzip is None:
                parts.append(chunk)
            else:
                gunzip.inflate(chunk, parts)
        if gunzip is not None:
            gunzip.finish()
        return b"".join(parts)

    def _admitted_encoding(self, scope: Scope) -> str:
        """The body's Content-Encoding, once its announced length, media type and
        encoding are ones this server takes."""
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.settings.max_body_bytes:
            raise _too_large(self.settings.max_body_bytes)
        media_type = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise _Reject(
                415, "Unsupported media type",
                f"the body must be JSON: send 'Content-Type: application/json' "
                f"(got {media_type or 'no Content-Type'})",
            )
        encoding = (_header(scope, b"content-encoding") or "identity").strip().lower()
        if encoding not in ("identity", "gzip", "x-gzip"):
            raise _Reject(
                415, "Unsupported Content-Encoding",
                f"Content-Encoding {encoding!r} is not supported; send identity or gzip",
                headers=[(b"accept-encoding", b"gzip")],
            )
        return encoding

    @staticmethod
    async def _send_problem(scope: Scope, send: Send, reject: _Reject) -> None:
        body = json.dumps(problem_body(
            reject.status, reject.title, reject.detail, type=reject.type,
            request_id=scope.get("state", {}).get("request_id"), instance=scope["path"],
        )).encode()
        await send({
            "type": "http.response.start",
            "status": reject.status,
            "headers": [(b"content-type", b"application/problem+json"),
                        (b"content-length", str(len(body)).encode()), *reject.headers],
        })
        await send({"type": "http.response.body", "body": body})
