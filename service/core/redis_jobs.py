"""Cluster jobs as their owners see them, and who wants a run: each owner's
submission of a job, clients waiting on any replica, and the job listings. A run
nobody wants any more is cancelled (``RQExecutor.abandon``).

Keys (beside ``redis_store``'s, under ``PREFIX``):

- ``{PREFIX}:owners:{key}``: a hash, owner (an API key's id, ``ANONYMOUS`` with keys
  off) -> JSON ``[created_at, withdrawal]`` (``runs.Withdrawal``), that owner's
  submission of the job; it lives as long as the run's record (no expiry while the
  run is unfinished);
- ``{PREFIX}:waiting:{key}``: a hash, waiter id -> the Redis time (ms) until which
  it counts. A replica waiting on a run renews its waiter every second or so; one
  that died stops counting ``WAITER_TTL_MS`` later, so a crash never cancels a run
  for a client still waiting elsewhere, and never keeps it wanted for long;
- ``{PREFIX}:jobs`` and ``{PREFIX}:jobs:{owner}``: sorted sets of job keys by
  ``created_at``, all jobs and one owner's submissions, for ``GET /v1/jobs``;
  trimmed of what is older than the TTL as they grow, and of what has gone from
  Redis as they are read.

The checks that decide are Lua scripts: atomic, and on Redis' one clock.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, cast

from redis import Redis

from optiremat.service.core.redis_records import PREFIX, run_key, run_record, text
from optiremat.service.core.runs import ANONYMOUS, JobRecord, Position, Withdrawal
from optiremat.solver.wire import JobStatus

# A waiter not renewed for this long is gone (its replica died).
WAITER_TTL_MS = 5000
# A listing's page looks at no more than this many times its length of entries.
_LIST_SCAN = 10

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


class RedisJobs:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self._wait = redis.register_script(_WAIT)
        self._withdraw = redis.register_script(_WITHDRAW)
        self._unwanted = redis.register_script(_UNWANTED)

    @staticmethod
    def owners_key(key: str) -> str:
        return f"{PREFIX}:owners:{key}"

    @staticmethod
    def waiting_key(key: str) -> str:
        return f"{PREFIX}:waiting:{key}"

    @staticmethod
    def jobs_key(owner: str | None = None) -> str:
        return f"{PREFIX}:jobs" if owner is None else f"{PREFIX}:jobs:{owner}"

    def index(self, pipe: Any, owner: str | None, key: str, created_at: float) -> None:
        """List the job in ``owner``'s listing (every job's with None), in ``pipe``."""
        listing = self.jobs_key(owner)
        pipe.zadd(listing, {key: created_at})
        pipe.zremrangebyscore(listing, "-inf", time.time() - self.ttl_s)

    # ---- submissions ------------------------------------------------------------

    def submission(self, key: str, owner: str) -> Submission | None:
        return _submission(self.redis.hget(self.owners_key(key), owner))

    def submissions(self, keys: list[str], owner: str) -> list[Submission | None]:
        with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(self.owners_key(key), owner)
            return [_submission(raw) for raw in pipe.execute()]

    def submit(self, key: str, owner: str) -> None:
        """``owner``'s submission of the recorded job, renewed from now unless it stands
        already; it lives while the run is unfinished, then as long as the run."""
        record = run_record(key, self.redis.hgetall(run_key(key)))
        assert record is not None, "submitted after the run was recorded"
        standing = self.submission(key, owner)
        if standing is None or standing.withdrawn:
            standing = Submission(time.time(), Withdrawal.NONE)
            self.redis.hset(self.owners_key(key), owner,
                            json.dumps([standing.created_at, Withdrawal.NONE]))
        if record.outcome is None:
            self.redis.persist(self.owners_key(key))
        else:
            self.redis.expire(self.owners_key(key), self.ttl_s)
        if owner != ANONYMOUS:
            with self.redis.pipeline() as pipe:
                self.index(pipe, owner, key, standing.created_at)
                pipe.execute()

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

    # ---- jobs as their owners see them ------------------------------------------

    def get_job(self, key: str, owner: str | None = None) -> JobRecord | None:
        """As ``runs.Store.get_job`` says."""
        record = run_record(key, self.redis.hgetall(run_key(key)))
        if record is None or not record.job:
            return None
        submission = self.submission(key, ANONYMOUS if owner is None else owner)
        if owner is not None and submission is None:
            return None
        if record.outcome is not None:  # a use renews a finished job's lifetime
            for renewed in (run_key(key), self.owners_key(key)):
                self.redis.expire(renewed, self.ttl_s)
        job = record.as_job()
        if submission is None:
            return job
        return replace(job, withdrawn=submission.withdrawn,
                       created_at=job.created_at if owner is None else submission.created_at)

    def list_jobs(self, owner: str | None, status: JobStatus | None, after: Position | None,
                  limit: int) -> tuple[list[JobRecord], Position | None]:
        """As ``runs.Store.list_jobs`` says; a page stops short after ``_LIST_SCAN`` times ``limit``
        entries looked at, so that a rare status costs pages, not one long request."""
        index = self.jobs_key(owner)
        top = "+inf" if after is None else after[0]
        jobs: list[JobRecord] = []
        gone: list[str] = []
        seen = 0
        position: Position | None = None
        while len(jobs) < limit and seen < _LIST_SCAN * limit:
            entries = cast(list[tuple[bytes, float]], self.redis.zrevrangebyscore(
                index, top, "-inf", start=seen, num=2 * limit, withscores=True))
            if not entries:
                position = None
                break
            seen += len(entries)
            with self.redis.pipeline(transaction=False) as pipe:
                for member, _ in entries:
                    pipe.hgetall(run_key(text(member)))
                raws = pipe.execute()
            submissions = self.submissions([text(m) for m, _ in entries],
                                            ANONYMOUS if owner is None else owner)
            for (member, score), raw, submission in zip(entries, raws, submissions,
                                                        strict=True):
                key = text(member)
                if after is not None and (score, key) >= after:
                    continue  # on the last page already
                position = (score, key)
                record = run_record(key, raw)
                if record is None or not record.job:
                    gone.append(key)
                    continue
                job = record.as_job()
                if submission is not None:
                    job = replace(job, withdrawn=submission.withdrawn, created_at=score)
                if status is None or job.status == status:
                    jobs.append(job)
                    if len(jobs) == limit:
                        break
        if gone:
            self.redis.zrem(index, *gone)
        return jobs, position

    # ---- waiters ----------------------------------------------------------------

    def wait(self, key: str, waiter: str) -> None:
        """Count ``waiter`` as waiting on the run for ``WAITER_TTL_MS`` more."""
        self._wait(keys=[self.waiting_key(key)], args=[waiter, WAITER_TTL_MS])

    def stop_waiting(self, key: str, waiter: str) -> None:
        self.redis.hdel(self.waiting_key(key), waiter)

    def unwanted(self, key: str) -> bool:
        """Whether the run is unfinished and nothing wants it."""
        return bool(self._unwanted(keys=[self.waiting_key(key), self.owners_key(key),
                                         run_key(key)]))
