"""Cluster mode's state in Redis: runs, answers, graphs, cancel flags and the RQ queues.

(Over 400 lines on purpose: every write to a run's record and to the queues it goes
through is here, so that each check-and-write and its Lua script are read together.
Jobs as owners see them are ``redis_jobs``, a run's fields ``redis_records``.)

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
- ``{PREFIX}:rate:{client}``: a client's rate-limit state (``redis_limits``),
  gone once the client is back under its limit;
- ``{PREFIX}:owners:{key}``, ``{PREFIX}:waiting:{key}``, ``{PREFIX}:jobs`` and
  ``{PREFIX}:jobs:{owner}``: who wants the run, and the job listings (``redis_jobs``).

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

import logging
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

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
from optiremat.service.core.redis_jobs import RedisJobs
from optiremat.service.core.redis_records import (
    PREFIX,
    RunRecord,
    run_key,
    run_record,
    text,
)
from optiremat.service.core.runs import JobRecord, Live, Position
from optiremat.service.core.tasks import Lane, Task, solver_version
from optiremat.solver.wire import STORE_UNAVAILABLE, JobStatus, Progress

log = logging.getLogger("optiremat.service")
# The solver stops at its own time limit; the queue's job timeout leaves this much on
# top for loading the graph, building the model and checking the plan, so a long
# solve ends with its incumbent instead of being killed.
JOB_TIMEOUT_MARGIN_S = 120
TASK_FUNCTION = "optiremat.service.core.rq_worker.run_job"
_LIVE = (RQStatus.QUEUED, RQStatus.STARTED, RQStatus.SCHEDULED, RQStatus.DEFERRED,
         RQStatus.CREATED, RQStatus.READY_TO_ENQUEUE)


def queue_name(lane: Lane = Lane.BACKGROUND) -> str:
    name = f"{PREFIX.replace(':', '.')}.{solver_version()}"
    return name if lane == Lane.BACKGROUND else f"{name}.{lane}"


def job_timeout_s(time_limit_s: float) -> int:
    return math.ceil(time_limit_s) + JOB_TIMEOUT_MARGIN_S


@dataclass(frozen=True)
class Usage:
    used_bytes: int
    max_bytes: int  # maxmemory; 0 when unbounded
    evicted_keys: int  # past maxmemory, since Redis started
    expired_keys: int  # past their TTL, since Redis started


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
        self.jobs = RedisJobs(redis, ttl_s)
        self._finish = redis.register_script(_FINISH)
        self._update_live = redis.register_script(_UPDATE_LIVE)

    run_key = staticmethod(run_key)

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
        stored = self.redis.getex(self.answer_key(key), ex=self.ttl_s)  # a use renews it
        if stored is None:
            return None
        answer = decode(stored)
        assert is_answer(answer)
        return answer

    def get_run(self, key: str) -> RunRecord | None:
        return run_record(key, self.redis.hgetall(self.run_key(key)))

    # the jobs as their owners see them (redis_jobs)

    def get_job(self, key: str, owner: str | None = None) -> JobRecord | None:
        return self.jobs.get_job(key, owner)

    def submit(self, key: str, owner: str) -> None:
        self.jobs.submit(key, owner)

    def withdraw(self, key: str, owner: str | None) -> bool:
        return self.jobs.withdraw(key, owner)

    def stopped_for(self, key: str, owner: str | None) -> None:
        self.jobs.stopped_for(key, owner)

    def wanted(self, key: str) -> bool:
        return self.jobs.wanted(key)

    def list_jobs(self, owner: str | None, status: JobStatus | None, after: Position | None,
                  limit: int) -> tuple[list[JobRecord], Position | None]:
        return self.jobs.list_jobs(owner, status, after, limit)

    def outcome(self, key: str) -> Outcome | None:
        encoded = self.redis.hget(self.run_key(key), "outcome")
        return None if encoded is None else decode(encoded)

    def get_graph(self, graph_hash: str) -> str | None:
        graph_json = self.redis.get(self.graph_key(graph_hash))
        return None if graph_json is None else text(graph_json)

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
                    record = run_record(key, pipe.hgetall(run_key))
                    if record is not None and reusable(record.outcome):
                        if job and not record.job:
                            pipe.multi()
                            pipe.hset(run_key, "job", "1")
                            self.jobs.index(pipe, None, key, record.created_at)
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
                        self.jobs.index(pipe, None, key, now)
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
        return None if policy is None else text(policy)

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
        encoded = encode(outcome)
        answer = encoded if is_answer(outcome) else ""
        written = self._finish(
            keys=[self.run_key(key), self.answer_key(key), self.graph_key(graph_hash),
                  self.graph_runs_key(graph_hash), self.jobs.owners_key(key)],
            args=[run.generation, encoded, time.time(), self.ttl_s,
                  progress.model_dump_json() if progress else "", answer, key],
        )
        if not written and answer:
            self.redis.set(self.answer_key(key), answer, ex=self.ttl_s, nx=True)
        return bool(written)


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
