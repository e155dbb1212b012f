"""Retries, in one place: an httpx transport that retries transient failures.

Connection failures (refused, connect timeout), the gateway answers 502, 503
and 504, and a rate limit's 429 are retried with exponential backoff and
jitter, honouring a ``Retry-After`` header up to the backoff cap. Every request the client sends is
safe to repeat: a solve is identified by its request hash, so a retried POST
joins or finds the same run.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import httpx

log = logging.getLogger("optiremat.client")

RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


class RetryTransport(httpx.BaseTransport):
    """Wraps a transport; ``retries`` is the number of extra attempts after the first."""

    def __init__(self, wrapped: httpx.BaseTransport | None = None, *, retries: int = 4,
                 backoff_s: float = 0.25, max_backoff_s: float = 8.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.wrapped = wrapped or httpx.HTTPTransport()
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        attempt = 0
        while True:
            retry_after = None
            try:
                response = self.wrapped.handle_request(request)
            except RETRY_ERRORS as exc:
                if attempt >= self.retries:
                    raise
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code not in RETRY_STATUSES or attempt >= self.retries:
                    return response
                retry_after = _seconds(response.headers.get("retry-after"))
                response.close()
                reason = f"HTTP {response.status_code}"
            delay = self.delay(attempt, retry_after)
            attempt += 1
            log.warning("%s %s: %s; retry %d of %d in %.2f s", request.method, request.url,
                        reason, attempt, self.retries, delay)
            self.sleep(delay)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds before retry ``attempt + 1``: the server's word, else backoff with jitter."""
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        ceiling = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return ceiling * random.uniform(0.5, 1.0)

    def close(self) -> None:
        self.wrapped.close()


def _seconds(header: str | None) -> float | None:
    """``Retry-After`` in delta-seconds (the HTTP-date form is treated as absent)."""
    if header is None:
        return None
    try:
        return max(0.0, float(header))
    except ValueError:
        return None
