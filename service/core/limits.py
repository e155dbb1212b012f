"""Rate limits: how many requests a client may send a minute, and how long to wait.

The algorithm is GCRA (the generic cell rate algorithm): a client's state is one
number, the theoretical arrival time (TAT) of its next request. Each request moves
it on by the emission interval (a minute over the limit); a request is turned away
while the TAT runs further ahead of now than the tolerance, a minute's worth of
requests. So a client may send ``per_minute`` requests at once, then one each
interval, and the answer to one sent too early says how long to wait.

``MemoryRateLimiter`` keeps the TATs in this process (embedded: one process
serves). Cluster mode keeps them in Redis (``redis_store.RedisRateLimiter``), so
that every API replica counts against the same limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# TATs that have fallen behind now are forgotten once this many clients are known.
_FORGET_AFTER = 10_000


@dataclass(frozen=True)
class Gcra:
    per_minute: int

    @property
    def interval_s(self) -> float:
        return 60.0 / self.per_minute

    @property
    def tolerance_s(self) -> float:
        return 60.0 - self.interval_s  # a minute's worth, the first one included

    def step(self, tat: float | None, now: float) -> tuple[float, float]:
        """(the TAT after a request at ``now``, seconds to wait: 0 when it is allowed)."""
        tat = now if tat is None or tat < now else tat
        wait = tat - now - self.tolerance_s
        if wait > 0:
            return tat, wait
        return tat + self.interval_s, 0.0


class RateLimiter(Protocol):
    async def wait_s(self, client: str) -> float:
        """Count a request from ``client``: 0 when it may go ahead, else the seconds
        until it may."""


class MemoryRateLimiter:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._gcra = Gcra(per_minute)
        self._clock = clock
        self._tats: dict[str, float] = {}

    async def wait_s(self, client: str) -> float:
        return self.count(client)

    def count(self, client: str) -> float:
        """``wait_s``, without the event loop."""
        now = self._clock()
        if len(self._tats) > _FORGET_AFTER:  # a fresh TAT is as good as a stale one
            self._tats = {c: tat for c, tat in self._tats.items() if tat > now}
        self._tats[client], wait = self._gcra.step(self._tats.get(client), now)
        return wait


class FailureThrottle(MemoryRateLimiter):
    """Failures a client may have a minute (an address's wrong API keys): a GCRA whose
    requests are the failures. It is looked at before each attempt, so a client past it
    is turned away without learning whether its next key was right. In this process
    only: in cluster mode each replica counts its own."""

    def blocked_s(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0 when it may now."""
        tat = self._tats.get(client)
        return 0.0 if tat is None else max(0.0, tat - self._clock() - self._gcra.tolerance_s)

    def record(self, client: str) -> None:
        """Count a failure of ``client``."""
        self.count(client)
