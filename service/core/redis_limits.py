"""``limits.RateLimiter`` in Redis, so that every API replica counts against one limit."""

from __future__ import annotations

import asyncio
import logging

from redis import Redis
from redis.exceptions import RedisError

from optiremat.service.core.limits import Gcra
from optiremat.service.core.redis_records import PREFIX

log = logging.getLogger("optiremat.service")

# limits.Gcra.step on Redis' clock, so that every replica counts against one limit.
# Times in microseconds; the key lives until its TAT has passed.
_RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local wait = tat - now - tonumber(ARGV[2])
if wait > 0 then return wait end
tat = tat + tonumber(ARGV[1])
redis.call('SET', KEYS[1], tat, 'PX', math.ceil((tat - now) / 1000))
return 0
"""


class RedisRateLimiter:
    """``limits.RateLimiter`` shared by every API replica. Redis not answering lets the
    request through: it will meet the same Redis and be answered 503."""

    def __init__(self, redis: Redis, per_minute: int) -> None:
        self._gcra = Gcra(per_minute)
        self._script = redis.register_script(_RATE)

    def _wait_s(self, client: str) -> float:
        waited = self._script(keys=[f"{PREFIX}:rate:{client}"], args=[
            round(self._gcra.interval_s * 1e6), round(self._gcra.tolerance_s * 1e6)])
        return int(waited) / 1e6

    async def wait_s(self, client: str) -> float:
        try:
            return await asyncio.to_thread(self._wait_s, client)
        except RedisError as exc:
            log.warning("rate limit not checked: Redis does not answer (%s)", exc)
            return 0.0
