"""Who wants a cluster run: each owner's job submission, and clients waiting on any
replica. A run nobody wants any more is cancelled (``RQExecutor.abandon``).

Keys (beside ``redis_store``'s, under its ``PREFIX``):

- ``{PREFIX}:owners:{key}``: a hash, owner (an API key's id, ``ANONYMOUS`` with keys
  off) -> JSON ``[created_at, withdrawal]`` (``runs.Withdrawal``), that owner's
  submission of the job; it
  lives as long as the run's record (no expiry while the run is unfinished);
- ``{PREFIX}:waiting:{key}``: a hash, waiter id -> the Redis time (ms) until which
  it counts. A replica waiting on a run renews its waiter every second or so; one
  that died stops counting ``WAITER_TTL_MS`` later, so a crash never cancels a run
  for a client still waiting elsewhere, and never keeps it wanted for long.

The checks that decide are Lua scripts: atomic, and on Redis' one clock.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from redis import Redis

from optiremat.service.core.runs import Withdrawal

# A waiter not renewed for this long is gone (its replica died).
WAITER_TTL_MS = 5000

_WAIT = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], until_ms)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""
# Moves every submission (ARGV[1] == '1') or ARGV[2]'s from withdrawal ARGV[3] to
# ARGV[4]. Returns whether a submission not withdrawn (0) remains.
_WITHDRAW = """
local entries = redis.call('HGETALL', KEYS[1])
local wanted = 0
for i = 1, #entries, 2 do
    local submission = cjson.decode(entries[i + 1])
    if (ARGV[1] == '1' or entries[i] == ARGV[2]) and submission[2] == tonumber(ARGV[3]) then
        submission[2] = tonumber(ARGV[4])
        redis.call('HSET', KEYS[1], entries[i], cjson.encode(submission))
    end
    if submission[2] == 0 then wanted = 1 end
end
return wanted
"""
# 1 when the run is unfinished and nothing wants it: no live waiter, no submission
# not withdrawn. Waiters past their time are dropped on the way.
_UNWANTED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local waiters = redis.call('HGETALL', KEYS[1])
local live = 0
for i = 1, #waiters, 2 do
    if tonumber(waiters[i + 1]) < now then
        redis.call('HDEL', KEYS[1], waiters[i])
    else
        live = 1
    end
end
if live == 1 then return 0 end
for _, value in ipairs(redis.call('HVALS', KEYS[2])) do
    if cjson.decode(value)[2] == 0 then return 0 end
end
if redis.call('EXISTS', KEYS[3]) == 1 and redis.call('HEXISTS', KEYS[3], 'outcome') == 0 then
    return 1
end
return 0
"""


@dataclass(frozen=True)
class Submission:
    created_at: float
    withdrawn: Withdrawal


def _submission(raw: bytes | str | None) -> Submission | None:
    if raw is None:
        return None
    created_at, withdrawn = json.loads(raw)
    return Submission(float(created_at), Withdrawal(withdrawn))


class RunInterest:
    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis
        self._prefix = prefix
        self._wait = redis.register_script(_WAIT)
        self._withdraw = redis.register_script(_WITHDRAW)
        self._unwanted = redis.register_script(_UNWANTED)

    def owners_key(self, key: str) -> str:
        return f"{self._prefix}:owners:{key}"

    def waiting_key(self, key: str) -> str:
        return f"{self._prefix}:waiting:{key}"

    # ---- submissions ------------------------------------------------------------

    def submission(self, key: str, owner: str) -> Submission | None:
        return _submission(self.redis.hget(self.owners_key(key), owner))

    def submissions(self, keys: list[str], owner: str) -> list[Submission | None]:
        with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(self.owners_key(key), owner)
            return [_submission(raw) for raw in pipe.execute()]

    def submit(self, key: str, owner: str, *, unfinished: bool, ttl_s: int) -> Submission:
        """``owner``'s submission, renewed from now unless it stands already."""
        standing = self.submission(key, owner)
        if standing is None or standing.withdrawn:
            standing = Submission(time.time(), Withdrawal.NONE)
            self.redis.hset(self.owners_key(key), owner,
                            json.dumps([standing.created_at, Withdrawal.NONE]))
        if unfinished:
            self.redis.persist(self.owners_key(key))
        else:
            self.redis.expire(self.owners_key(key), ttl_s)
        return standing

    def _move(self, key: str, owner: str | None, old: Withdrawal, new: Withdrawal) -> bool:
        return bool(self._withdraw(keys=[self.owners_key(key)], args=[
            "1" if owner is None else "0", owner or "", int(old), int(new)]))

    def withdraw(self, key: str, owner: str | None) -> bool:
        return self._move(key, owner, Withdrawal.NONE, Withdrawal.LEFT)

    def stopped_for(self, key: str, owner: str | None) -> None:
        self._move(key, owner, Withdrawal.LEFT, Withdrawal.STOPPED)

    def wanted(self, key: str) -> bool:
        return any(not submission.withdrawn for raw in
                   self.redis.hvals(self.owners_key(key))
                   if (submission := _submission(raw)) is not None)

    # ---- waiters ----------------------------------------------------------------

    def wait(self, key: str, waiter: str) -> None:
        """Count ``waiter`` as waiting on the run for ``WAITER_TTL_MS`` more."""
        self._wait(keys=[self.waiting_key(key)], args=[waiter, WAITER_TTL_MS])

    def stop_waiting(self, key: str, waiter: str) -> None:
        self.redis.hdel(self.waiting_key(key), waiter)

    def unwanted(self, key: str, run_key: str) -> bool:
        """Whether the run is unfinished and nothing wants it."""
        return bool(self._unwanted(keys=[self.waiting_key(key), self.owners_key(key),
                                         run_key]))
