"""Cluster mode's state in Redis: runs, answers, graphs, cancel flags and the RQ queue.

Blocking calls, shared by the API replicas (through ``asyncio.to_thread``) and the
RQ workers; it imports neither FastAPI nor JAX. Outcomes are kept in the one codec
of ``optiremat.service.core.outcome``, as in the SQLite store.

Keys (``PREFIX`` carries the layout's version):

- ``{PREFIX}:run:{key}``: a hash per request hash, the run of that request:
  ``task``, ``job`` (submitted through ``/v1/jobs``), ``generation`` (a fresh id
  each time the run is started, so a late write from an older run is ignored),
  times, ``progress``, ``worker``, and ``outcome`` once it has finished;
- ``{PREFIX}:answer:{key}``: the cached answer (a plan, an infeasible budget, a
  budget range); written once, with the run's outcome;
- ``{PREFIX}:graph:{graph_hash}``: the canonical graph JSON, uploaded once per
  graph rather than once per budget;
- ``{PREFIX}:cancel:{key}``: set to cancel; the worker solving ``key`` polls it;
- ``{PREFIX}:graph_runs:{graph_hash}``: the unfinished runs that need the graph;
- ``{PREFIX}:rate:{client}``: a client's rate-limit state (``RedisRateLimiter``),
  gone once the client is back under its limit;
- ``{PREFIX}:owners:{key}`` and ``{PREFIX}:waiting:{key}``: who wants the run
  (``redis_interest``);
- ``{PREFIX}:jobs`` and ``{PREFIX}:jobs:{owner}``: sorted sets of job keys by
  ``created_at``, all jobs and one API key's id's submissions, for ``GET /v1/jobs``;
  trimmed of what is older than ``ttl_s`` as they grow, and of what has gone from
  Redis as they are read.

Bounds: what is finished expires ``ttl_s`` after its last use (a read renews an
answer's or a finished run's lifetime), and Redis' ``maxmemory`` with
``maxmemory-policy volatile-ttl`` evicts the keys closest to expiring first, that
is, the least recently used. An unfinished run, and the graph it needs, have no
expiry until the run finishes: ``volatile-*`` policies never evict them, nor RQ's
queue and registries (docker/README.md).

The RQ job that runs a request has the request hash as its id, so a request is
queued once however many replicas receive it. Its queue is named after the
layout, the solver version and the run's lane (``queue_name``): a worker only takes
requests whose hash its own solver would compute, and a rolling upgrade never mixes
them; a worker takes sync runs before jobs, and ``--sync-only`` ones nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError, WatchError
from rq import Queue, Retry
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job as RQJob
from rq.job import JobStatus as RQStatus
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.serializers import JSONSerializer

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.limits import Gcra
from optiremat.service.core.outcome import (
    Answer,
    Cancelled,
    Failed,
    Outcome,
    decode,
    encode,
    is_answer,
    reusable,
)
from optiremat.service.core.redis_interest import RunInterest
from optiremat.service.core.runs import ANONYMOUS, JobRecord, Live, Position
from optiremat.service.core.tasks import TASKS, Lane, SolveTask, Task, solver_version
from optiremat.solver.wire import STORE_UNAVAILABLE, JobStatus, Progress

log = logging.getLogger("optiremat.service")
# 2: one outcome codec for both stores, runs keyed by their task (1 had its own codec)
PREFIX = "optiremat:v2"
# The solver stops at its own time limit; the queue's job timeout leaves this much on
# top for loading the graph, building the model and checking the plan, so a long
# solve ends with its incumbent instead of being killed.
JOB_TIMEOUT_MARGIN_S = 120
TASK_FUNCTION = "optiremat.service.core.rq_worker.run_job"
_LIST_SCAN = 10
_LIVE = (RQStatus.QUEUED, RQStatus.STARTED, RQStatus.SCHEDULED, RQStatus.DEFERRED,
         RQStatus.CREATED, RQStatus.READY_TO_ENQUEUE)


def queue_name(lane: Lane = Lane.BACKGROUND) -> str:
    name = f"{PREFIX.replace(':', '.')}.{solver_version()}"
    return name if lane == Lane.BACKGROUND else f"{name}.{lane}"


def job_timeout_s(time_limit_s: float) -> int:
    return math.ceil(time_limit_s) + JOB_TIMEOUT_MARGIN_S


@dataclass(frozen=True)
class RunRecord:
    key: str
    task: Task
    job: bool
    generation: str
    created_at: float
    updated_at: float
    progress: Progress | None
    outcome: Outcome | None
    started: bool = False  # a worker took it (it may since have died and been requeued)

    def as_job(self) -> JobRecord:
        assert isinstance(self.task, SolveTask)
        return JobRecord(self.key, self.task, self.created_at, self.updated_at, self.outcome,
                         self.progress, self.started)


@dataclass(frozen=True)
class Usage:
    used_bytes: int
    max_bytes: int  # maxmemory; 0 when unbounded
    evicted_keys: int  # past maxmemory, since Redis started
    expired_keys: int  # past their TTL, since Redis started


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _record(key: str, raw: Mapping[Any, Any]) -> RunRecord | None:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    if "generation" not in fields:
        return None  # no run, or a stray write to an expired one
    progress = fields.get("progress")
    outcome = fields.get("outcome")
    return RunRecord(
        key=key,
        task=TASKS.validate_json(fields["task"]),
        job=fields.get("job") == "1",
        generation=fields["generation"],
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        progress=Progress.model_validate_json(progress) if progress else None,
        outcome=None if outcome is None else decode(outcome),
        started="started_at" in fields,
    )


# Lua keeps each check-and-write atomic: a run's outcome is written once, and only by
# (or for) the generation that is current.
# Finishing starts the run's lifetime and, when no other unfinished run needs the
# graph, the graph's.
_FINISH = """
if redis.call('HGET', KEYS[1], 'generation') == ARGV[1]
        and redis.call('HEXISTS', KEYS[1], 'outcome') == 0 then
    redis.call('HSET', KEYS[1], 'outcome', ARGV[2], 'updated_at', ARGV[3])
    if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'progress', ARGV[5]) end
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    if ARGV[6] ~= '' then redis.call('SET', KEYS[2], ARGV[6], 'EX', ARGV[4]) end
    redis.call('EXPIRE', KEYS[5], ARGV[4])
    redis.call('SREM', KEYS[4], ARGV[7])
    if redis.call('SCARD', KEYS[4]) == 0 then redis.call('EXPIRE', KEYS[3], ARGV[4]) end
    return 1
end
return 0
"""
_UPDATE_LIVE = """
if redis.call('HGET', KEYS[1], 'generation') == ARGV[1]
        and redis.call('HEXISTS', KEYS[1], 'outcome') == 0 then
    for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    return 1
end
return 0
"""


class RedisStore:
    def __init__(self, redis: Redis, ttl_s: int, retries: int = 0) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.retries = retries
        self.queues = {lane: Queue(queue_name(lane), connection=redis,
                                   serializer=JSONSerializer) for lane in Lane}
        self.interest = RunInterest(redis, PREFIX)
        self._finish = redis.register_script(_FINISH)
        self._update_live = redis.register_script(_UPDATE_LIVE)

    @staticmethod
    def run_key(key: str) -> str:
        return f"{PREFIX}:run:{key}"

    @staticmethod
    def answer_key(key: str) -> str:
        return f"{PREFIX}:answer:{key}"

    @staticmethod
    def graph_key(graph_hash: str) -> str:
        return f"{PREFIX}:graph:{graph_hash}"

    @staticmethod
    def cancel_key(key: str) -> str:
        return f"{PREFIX}:cancel:{key}"

    @staticmethod
    def graph_runs_key(graph_hash: str) -> str:
        return f"{PREFIX}:graph_runs:{graph_hash}"

    @staticmethod
    def jobs_key(owner: str | None = None) -> str:
        return f"{PREFIX}:jobs" if owner is None else f"{PREFIX}:jobs:{owner}"

    def _index(self, pipe: Any, owner: str | None, key: str, created_at: float) -> None:
        index = self.jobs_key(owner)
        pipe.zadd(index, {key: created_at})
        pipe.zremrangebyscore(index, "-inf", time.time() - self.ttl_s)

    def queued(self) -> int:
        """Runs waiting for a worker, in every lane."""
        return sum(queue.count for queue in self.queues.values())

    def unavailable(self, exc: Exception) -> Unavailable | None:
        if not isinstance(exc, RedisError):
            return None
        return Unavailable.of(
            STORE_UNAVAILABLE,
            f"Redis does not answer ({type(exc).__name__}: {exc}); retry shortly")

    # ---- reads ------------------------------------------------------------------

    def ping(self) -> None:
        self.redis.ping()

    def get_answer(self, key: str) -> Answer | None:
        text = self.redis.getex(self.answer_key(key), ex=self.ttl_s)  # a use renews it
        if text is None:
            return None
        answer = decode(text)
        assert is_answer(answer)
        return answer

    def get_run(self, key: str) -> RunRecord | None:
        return _record(key, self.redis.hgetall(self.run_key(key)))

    def get_job(self, key: str, owner: str | None = None) -> JobRecord | None:
        record = self.get_run(key)
        if record is None or not record.job:
            return None
        submission = self.interest.submission(key, ANONYMOUS if owner is None else owner)
        if owner is not None and submission is None:
            return None
        if record.outcome is not None:  # a use renews a finished job's lifetime
            for renewed in (self.run_key(key), self.interest.owners_key(key)):
                self.redis.expire(renewed, self.ttl_s)
        job = record.as_job()
        if submission is None:
            return job
        return replace(job, withdrawn=submission.withdrawn,
                       created_at=job.created_at if owner is None else submission.created_at)

    def submit(self, key: str, owner: str) -> None:
        record = self.get_run(key)
        assert record is not None, "submitted after the run was recorded"
        submission = self.interest.submit(key, owner, unfinished=record.outcome is None,
                                          ttl_s=self.ttl_s)
        if owner != ANONYMOUS:
            with self.redis.pipeline() as pipe:
                self._index(pipe, owner, key, submission.created_at)
                pipe.execute()

    def withdraw(self, key: str, owner: str | None) -> bool:
        return self.interest.withdraw(key, owner)

    def stopped_for(self, key: str, owner: str | None) -> None:
        self.interest.stopped_for(key, owner)

    def wanted(self, key: str) -> bool:
        return self.interest.wanted(key)

    def list_jobs(self, owner: str | None, status: JobStatus | None, after: Position | None,
                  limit: int) -> tuple[list[JobRecord], Position | None]:
        """As the protocol says; a page stops short after ``_LIST_SCAN`` times ``limit``
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
                    pipe.hgetall(self.run_key(_text(member)))
                raws = pipe.execute()
            submissions = self.interest.submissions([_text(m) for m, _ in entries],
                                                    ANONYMOUS if owner is None else owner)
            for (member, score), raw, submission in zip(entries, raws, submissions,
                                                        strict=True):
                key = _text(member)
                if after is not None and (score, key) >= after:
                    continue  # on the last page already
                position = (score, key)
                record = _record(key, raw)
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

    def outcome(self, key: str) -> Outcome | None:
        text = self.redis.hget(self.run_key(key), "outcome")
        return None if text is None else decode(text)

    def get_graph(self, graph_hash: str) -> str | None:
        text = self.redis.get(self.graph_key(graph_hash))
        return None if text is None else _text(text)

    def cancel_requested(self, key: str) -> bool:
        return bool(self.redis.exists(self.cancel_key(key)))

    # ---- the API's side ---------------------------------------------------------

    def has_graph(self, graph_hash: str) -> bool:
        """True when the graph is stored already; its lifetime is renewed unless an
        unfinished run holds it (then it has none)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(self.graph_key(graph_hash))
            pipe.expire(self.graph_key(graph_hash), self.ttl_s, xx=True)
            exists, _ = pipe.execute()
        return bool(exists)

    def put_graph(self, graph_hash: str, graph_json: str) -> None:
        # nx: a graph stored meanwhile may be held by a run, without expiry: keep it so
        self.redis.set(self.graph_key(graph_hash), graph_json, ex=self.ttl_s, nx=True)

    def ensure_run(self, task: Task, *, job: bool) -> tuple[RunRecord, bool]:
        """The request's run, and whether this call started it.

        A run still going or answered is joined. Otherwise (none, or failed,
        cancelled, infeasible) a new generation starts: answered at once from the
        answer cache when it can be, else queued. WATCH makes the check and the
        enqueue one transaction, so replicas racing on one request queue it once.
        """
        key = task.key
        run_key = self.run_key(key)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(run_key)
                    record = _record(key, pipe.hgetall(run_key))
                    if record is not None and reusable(record.outcome):
                        if job and not record.job:
                            pipe.multi()
                            pipe.hset(run_key, "job", "1")
                            self._index(pipe, None, key, record.created_at)
                            pipe.execute()
                            record = replace(record, job=True)
                        return record, False
                    cached = self.get_answer(key)
                    now = time.time()
                    record = RunRecord(key, task, job or bool(record and record.job),
                                       uuid.uuid4().hex, now, now, None, cached)
                    pipe.multi()
                    pipe.delete(run_key, self.cancel_key(key))
                    pipe.hset(run_key, mapping={
                        "task": task.model_dump_json(), "job": "1" if record.job else "0",
                        "generation": record.generation, "created_at": now, "updated_at": now,
                        **({"outcome": encode(cached)} if cached is not None else {}),
                    })
                    if record.job:
                        self._index(pipe, None, key, now)
                    if cached is None:  # unfinished: no expiry, and it holds its graph
                        pipe.sadd(self.graph_runs_key(task.graph_hash), key)
                        pipe.persist(self.graph_key(task.graph_hash))
                        self._enqueue(pipe, record)
                    else:
                        pipe.expire(run_key, self.ttl_s)
                    pipe.execute()
                    return record, cached is None
                except WatchError:
                    continue

    def _enqueue(self, pipe: Any, record: RunRecord) -> None:
        key = record.key
        # The id is reused across generations: drop what RQ kept of the last run, so its
        # registries' expiry cannot later delete the new job or report its old result.
        for queue in self.queues.values():  # the last run may have been in either lane
            for registry in (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry):
                registry(queue=queue).remove(key, pipeline=pipe)
        pipe.delete(RQJob.key_for(key), Result.get_key(key))
        lane = Lane.BACKGROUND if record.job else Lane.SYNC
        self.queues[lane].enqueue_call(
            TASK_FUNCTION,
            args=(record.task.model_dump(mode="json"), key, record.generation, self.ttl_s),
            job_id=key,
            timeout=job_timeout_s(record.task.time_limit_s),
            result_ttl=self.ttl_s,
            failure_ttl=self.ttl_s,
            retry=Retry(max=self.retries) if self.retries else None,
            description=f"{record.task.kind} {key}",
            pipeline=pipe,
        )

    def live(self, key: str) -> Live:
        """An unfinished run as RQ sees it. A run whose RQ job failed (its worker died
        and the retries are spent, or it ran past the job timeout) or vanished is
        finished here as failed, with RQ's reason: never left running."""
        try:
            job: RQJob | None = RQJob.fetch(key, connection=self.redis,
                                            serializer=JSONSerializer)
        except NoSuchJobError:
            job = None
        status = None if job is None else job.get_status(refresh=False)
        if status in _LIVE:
            return Live(None, running=status == RQStatus.STARTED)
        record = self.get_run(key)  # after the job: it may have finished meanwhile
        if record is None:
            return Live(Failed(message="the run's record expired from Redis; submit it again"))
        if record.outcome is not None:
            return Live(record.outcome)
        if job is not None and job.args[2] != record.generation:
            return Live(None)  # restarted between the two reads: look again later
        self.finish(record, Failed(message=_failure_reason(job, self.retries)))
        outcome = self.outcome(key)
        assert outcome is not None
        return Live(outcome)

    def cancel(self, key: str) -> None:
        """Flag the unfinished run for the worker that solves it; a run still in the
        queue is taken out and finished as cancelled at once."""
        record = self.get_run(key)
        if record is None or record.outcome is not None:
            return
        self.redis.set(self.cancel_key(key), "1", ex=self.ttl_s)
        try:
            job = RQJob.fetch(key, connection=self.redis, serializer=JSONSerializer)
            if job.get_status(refresh=False) == RQStatus.QUEUED:
                job.cancel()
                self.finish(record, Cancelled())
        except (NoSuchJobError, InvalidJobOperation):
            pass  # gone or taken meanwhile: the worker sees the flag

    def reap(self, lock_s: float) -> tuple[int, int]:
        """Hand runs whose worker stopped heartbeating back to RQ (retried while
        retries last, else failed) and count (queued, running) jobs.

        One cleaner at a time, or two could queue one retry twice: this takes the
        lock RQ's workers take for their own registry maintenance, and lets it
        expire after ``lock_s`` rather than deleting it, so replicas reap in turn
        and one dying here holds nobody up.
        """
        queues = self.queues.values()
        if self.redis.set(self.queues[Lane.BACKGROUND].registry_cleaning_key, "1", nx=True,
                          px=int(lock_s * 1000)):
            for queue in queues:
                StartedJobRegistry(queue=queue).cleanup()
        running = sum(StartedJobRegistry(queue=queue).get_job_count(cleanup=False)
                      for queue in queues)
        return self.queued(), running

    def usage(self) -> Usage:
        """Redis' memory and what it has dropped since it started."""
        memory = self.redis.info("memory")
        stats = self.redis.info("stats")
        return Usage(int(memory["used_memory"]), int(memory.get("maxmemory", 0)),
                     int(stats["evicted_keys"]), int(stats["expired_keys"]))

    def eviction_policy(self) -> str | None:
        """Redis' maxmemory-policy (None when CONFIG says nothing)."""
        policy = next(iter(self.redis.config_get("maxmemory-policy").values()), None)
        return None if policy is None else _text(policy)

    def worker_count(self) -> int:
        from rq import Worker

        return len({worker.name for queue in self.queues.values()
                    for worker in Worker.all(queue=queue)})

    # ---- the worker's side ------------------------------------------------------

    def update_live(self, key: str, generation: str, fields: dict[str, str | float]) -> bool:
        """Write fields of a run that is current and unfinished; False otherwise."""
        argv: list[str | float] = [generation]
        for name, value in fields.items():
            argv += [name, value]
        return bool(self._update_live(keys=[self.run_key(key)], args=argv))

    def finish(self, run: RunRecord, outcome: Outcome, progress: Progress | None = None) -> bool:
        """Record how the run ended (once) and cache an answer; False if the run had
        finished already or was restarted meanwhile (the answer is cached anyway:
        it is the same answer)."""
        key, graph_hash = run.key, run.task.graph_hash
        text = encode(outcome)
        answer = text if is_answer(outcome) else ""
        written = self._finish(
            keys=[self.run_key(key), self.answer_key(key), self.graph_key(graph_hash),
                  self.graph_runs_key(graph_hash), self.interest.owners_key(key)],
            args=[run.generation, text, time.time(), self.ttl_s,
                  progress.model_dump_json() if progress else "", answer, key],
        )
        if not written and answer:
            self.redis.set(self.answer_key(key), answer, ex=self.ttl_s, nx=True)
        return bool(written)


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


def _failure_reason(job: RQJob | None, retries: int) -> str:
    if job is None:
        return "the queued job vanished from Redis (was Redis flushed or restarted without " \
               "persistence?); submit the request again"
    latest = job.latest_result()
    detail = (latest.exc_string or "").strip().splitlines()[-1:] if latest else []
    cause = detail[0] if detail else f"its RQ job is {job.get_status(refresh=False)}"
    if "AbandonedJobError" in cause:
        cause = "the worker running it stopped heartbeating (killed, out of memory, or its " \
                "node was lost)"
    elif "JobTimeoutException" in cause:
        cause = "it ran past the queue's job timeout"
    tries = f"after {retries + 1} attempts" if retries else "and retries are off"
    return f"the solve did not finish: {cause}; it failed {tries}"
