"""Cluster mode's state in Redis: runs, results, graphs, cancel flags and the RQ queue.

Blocking calls, shared by the API replicas (through ``asyncio.to_thread``) and the
RQ workers; like ``optiremat.service.core.worker`` it imports neither FastAPI nor JAX.

Keys, each expiring ``ttl_s`` after its last write:

- ``optiremat:run:{key}``: a hash per request hash, the run of that request:
  ``kind``, ``spec``, ``job`` (submitted through ``/v1/jobs``), ``generation`` (a
  fresh id each time the run is started, so a late write from an older run is
  ignored), times, ``progress``, and ``outcome`` once it has finished;
- ``optiremat:result:{key}``: the cached answer (a plan, an infeasible budget, a
  budget range); written once, with the run's outcome;
- ``optiremat:graph:{graph_hash}``: the canonical graph JSON, uploaded once per
  graph rather than once per budget;
- ``optiremat:cancel:{key}``: set to cancel; the worker solving ``key`` polls it.

The RQ job that runs a request has the request hash as its id, so a request is
queued once however many replicas receive it. Its queue is named after the
solver version (``optiremat.<version>``): a worker only takes requests whose hash
its own solver would compute, and a rolling upgrade never mixes versions.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from redis import Redis
from redis.exceptions import WatchError
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

from optiremat.service.core.pool import Cancelled, Outcome
from optiremat.service.core.worker import BudgetRange, Failed, Infeasible, Solved, solver_version

PREFIX = "optiremat"
# The solver stops at its own time limit; the queue's job timeout leaves this much on
# top for loading the graph, building the model and checking the plan, so a long
# solve ends with its incumbent instead of being killed.
JOB_TIMEOUT_MARGIN_S = 120
TASK_FUNCTION = "optiremat.service.core.rq_worker.run_job"
_LIVE = (RQStatus.QUEUED, RQStatus.STARTED, RQStatus.SCHEDULED, RQStatus.DEFERRED,
         RQStatus.CREATED, RQStatus.READY_TO_ENQUEUE)

StoredResult = Solved | Infeasible | BudgetRange


def queue_name() -> str:
    return f"{PREFIX}.{solver_version()}"


def job_timeout_s(time_limit_s: float) -> int:
    return math.ceil(time_limit_s) + JOB_TIMEOUT_MARGIN_S


# ---- outcomes as JSON --------------------------------------------------------


def encode_outcome(outcome: Outcome) -> str:
    return json.dumps(_outcome_doc(outcome))


def _outcome_doc(outcome: Outcome | None) -> dict[str, Any] | None:
    if outcome is None:
        return None
    if isinstance(outcome, Solved):  # the solution's JSON is kept as a string: served as is
        return {"type": "solved", "solution_json": outcome.solution_json}
    if isinstance(outcome, Infeasible):
        return {"type": "infeasible", "budget_bytes": outcome.budget_bytes,
                "min_budget_bytes": outcome.min_budget_bytes}
    if isinstance(outcome, BudgetRange):
        return {"type": "budget_range", "min": outcome.min_feasible_budget,
                "max": outcome.max_useful_budget}
    if isinstance(outcome, Failed):
        return {"type": "failed", "message": outcome.message}
    if isinstance(outcome, Cancelled):
        return {"type": "cancelled", "partial": _outcome_doc(outcome.partial)}
    raise TypeError(f"{outcome!r} is not stored")


def decode_outcome(text: str | bytes) -> Outcome:
    outcome = _from_doc(json.loads(text))
    assert outcome is not None
    return outcome


def _from_doc(doc: dict[str, Any] | None) -> Outcome | None:
    if doc is None:
        return None
    kind = doc["type"]
    if kind == "solved":
        return Solved(doc["solution_json"])
    if kind == "infeasible":
        return Infeasible(doc["budget_bytes"], doc["min_budget_bytes"])
    if kind == "budget_range":
        return BudgetRange(doc["min"], doc["max"])
    if kind == "failed":
        return Failed(doc["message"])
    partial = _from_doc(doc["partial"])
    assert partial is None or isinstance(partial, Solved | Infeasible | BudgetRange | Failed)
    return Cancelled(partial)


def reusable(outcome: Outcome | None) -> bool:
    """A run still going, or one that answered: joined, never started again. A failed,
    cancelled or infeasible one is started again by the next request, as in the
    embedded mode (an infeasible budget is then answered from the cache)."""
    return outcome is None or isinstance(outcome, Solved | BudgetRange)


# ---- records -------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    key: str
    kind: str
    spec: dict[str, Any]
    job: bool
    generation: str
    created_at: float
    updated_at: float
    progress: dict[str, Any] | None
    outcome: Outcome | None


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
        kind=fields["kind"],
        spec=json.loads(fields["spec"]),
        job=fields.get("job") == "1",
        generation=fields["generation"],
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        progress=json.loads(progress) if progress else None,
        outcome=None if outcome is None else decode_outcome(outcome),
    )


@dataclass(frozen=True)
class Live:
    """Where an unfinished run stands: ``outcome`` once it has finished (or has been
    found dead), else whether a worker is on it."""

    outcome: Outcome | None
    running: bool


# Lua keeps each check-and-write atomic: a run's outcome is written once, and only by
# (or for) the generation that is current.
_FINISH = """
if redis.call('HGET', KEYS[1], 'generation') == ARGV[1]
        and redis.call('HEXISTS', KEYS[1], 'outcome') == 0 then
    redis.call('HSET', KEYS[1], 'outcome', ARGV[2], 'updated_at', ARGV[3])
    if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'progress', ARGV[5]) end
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    if ARGV[6] ~= '' then redis.call('SET', KEYS[2], ARGV[6], 'EX', ARGV[4]) end
    return 1
end
return 0
"""
_UPDATE_LIVE = """
if redis.call('HGET', KEYS[1], 'generation') == ARGV[1]
        and redis.call('HEXISTS', KEYS[1], 'outcome') == 0 then
    for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    redis.call('EXPIRE', KEYS[1], ARGV[2])
    return 1
end
return 0
"""


class ClusterStore:
    def __init__(self, redis: Redis, ttl_s: int, retries: int = 0) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.retries = retries
        self.queue = Queue(queue_name(), connection=redis, serializer=JSONSerializer)
        self._finish = redis.register_script(_FINISH)
        self._update_live = redis.register_script(_UPDATE_LIVE)

    @staticmethod
    def run_key(key: str) -> str:
        return f"{PREFIX}:run:{key}"

    @staticmethod
    def result_key(key: str) -> str:
        return f"{PREFIX}:result:{key}"

    @staticmethod
    def graph_key(graph_hash: str) -> str:
        return f"{PREFIX}:graph:{graph_hash}"

    @staticmethod
    def cancel_key(key: str) -> str:
        return f"{PREFIX}:cancel:{key}"

    # ---- reads ------------------------------------------------------------------

    def ping(self) -> None:
        self.redis.ping()

    def get_result(self, key: str) -> StoredResult | None:
        text = self.redis.get(self.result_key(key))
        if text is None:
            return None
        result = decode_outcome(text)
        assert isinstance(result, Solved | Infeasible | BudgetRange)
        return result

    def get_run(self, key: str) -> RunRecord | None:
        return _record(key, self.redis.hgetall(self.run_key(key)))

    def outcome(self, key: str) -> Outcome | None:
        text = self.redis.hget(self.run_key(key), "outcome")
        return None if text is None else decode_outcome(text)

    def get_graph(self, graph_hash: str) -> str | None:
        text = self.redis.get(self.graph_key(graph_hash))
        return None if text is None else _text(text)

    def cancel_requested(self, key: str) -> bool:
        return bool(self.redis.exists(self.cancel_key(key)))

    # ---- the API's side ---------------------------------------------------------

    def has_graph(self, graph_hash: str) -> bool:
        """True (and its lifetime renewed) when the graph is stored already."""
        return bool(self.redis.expire(self.graph_key(graph_hash), self.ttl_s))

    def put_graph(self, graph_hash: str, graph_json: str) -> None:
        self.redis.set(self.graph_key(graph_hash), graph_json, ex=self.ttl_s)

    def ensure_run(self, key: str, kind: str, spec: dict[str, Any], payload: dict[str, Any],
                   *, time_limit_s: float, as_job: bool) -> tuple[RunRecord, bool]:
        """The request's run, and whether this call started it.

        A run still going or answered is joined. Otherwise (none, or failed,
        cancelled, infeasible) a new generation starts: answered at once from the
        result cache when it can be, else queued. WATCH makes the check and the
        enqueue one transaction, so replicas racing on one request queue it once.
        """
        run_key = self.run_key(key)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(run_key)
                    record = _record(key, pipe.hgetall(run_key))
                    if record is not None and reusable(record.outcome):
                        if as_job and not record.job:
                            pipe.multi()
                            pipe.hset(run_key, "job", "1")
                            pipe.execute()
                            record = replace(record, job=True)
                        return record, False
                    cached = self.get_result(key)
                    now = time.time()
                    record = RunRecord(key, kind, spec, as_job or bool(record and record.job),
                                       uuid.uuid4().hex, now, now, None, cached)
                    pipe.multi()
                    pipe.delete(run_key, self.cancel_key(key))
                    pipe.hset(run_key, mapping={
                        "kind": kind, "spec": json.dumps(spec), "job": "1" if record.job else "0",
                        "generation": record.generation, "created_at": now, "updated_at": now,
                        **({"outcome": encode_outcome(cached)} if cached is not None else {}),
                    })
                    pipe.expire(run_key, self.ttl_s)
                    if cached is None:
                        self._enqueue(pipe, record, payload, time_limit_s)
                    pipe.execute()
                    return record, cached is None
                except WatchError:
                    continue

    def _enqueue(self, pipe: Any, record: RunRecord, payload: dict[str, Any],
                 time_limit_s: float) -> None:
        key = record.key
        # The id is reused across generations: drop what RQ kept of the last run, so its
        # registries' expiry cannot later delete the new job or report its old result.
        for registry in (FinishedJobRegistry, FailedJobRegistry, CanceledJobRegistry):
            registry(queue=self.queue).remove(key, pipeline=pipe)
        pipe.delete(RQJob.key_for(key), Result.get_key(key))
        self.queue.enqueue_call(
            TASK_FUNCTION,
            args=(record.kind, key, record.generation, payload, self.ttl_s),
            job_id=key,
            timeout=job_timeout_s(time_limit_s),
            result_ttl=self.ttl_s,
            failure_ttl=self.ttl_s,
            retry=Retry(max=self.retries) if self.retries else None,
            description=f"{record.kind} {key}",
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
            return Live(None, status == RQStatus.STARTED)
        record = self.get_run(key)  # after the job: it may have finished meanwhile
        if record is None:
            return Live(Failed("the run's record expired from Redis; submit it again"), False)
        if record.outcome is not None:
            return Live(record.outcome, False)
        if job is not None and job.args[2] != record.generation:
            return Live(None, False)  # restarted between the two reads: look again later
        self.finish(key, record.generation, Failed(_failure_reason(job, self.retries)))
        outcome = self.outcome(key)
        assert outcome is not None
        return Live(outcome, False)

    def cancel(self, key: str, generation: str) -> None:
        """Flag the run for the worker that solves it; a run still in the queue is
        taken out and finished as cancelled at once."""
        self.redis.set(self.cancel_key(key), "1", ex=self.ttl_s)
        try:
            job = RQJob.fetch(key, connection=self.redis, serializer=JSONSerializer)
            if job.get_status(refresh=False) == RQStatus.QUEUED:
                job.cancel()
                self.finish(key, generation, Cancelled(None))
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
        if self.redis.set(self.queue.registry_cleaning_key, "1", nx=True,
                          px=int(lock_s * 1000)):
            StartedJobRegistry(queue=self.queue).cleanup()
        running = StartedJobRegistry(queue=self.queue).get_job_count(cleanup=False)
        return self.queue.count, running

    def worker_count(self) -> int:
        from rq import Worker

        return Worker.count(connection=self.redis, queue=self.queue)

    # ---- the worker's side ------------------------------------------------------

    def update_live(self, key: str, generation: str, fields: dict[str, str | float]) -> bool:
        """Write fields of a run that is current and unfinished; False otherwise."""
        argv: list[str | float] = [generation, self.ttl_s]
        for name, value in fields.items():
            argv += [name, value]
        return bool(self._update_live(keys=[self.run_key(key)], args=argv))

    def finish(self, key: str, generation: str, outcome: Outcome,
               progress: dict[str, Any] | None = None) -> bool:
        """Record the run's outcome (once) and cache an answer; False if the run had
        finished already or was restarted meanwhile (the answer is cached anyway:
        it is the same answer)."""
        cacheable = isinstance(outcome, Solved | Infeasible | BudgetRange)
        written = self._finish(
            keys=[self.run_key(key), self.result_key(key)],
            args=[generation, encode_outcome(outcome), time.time(), self.ttl_s,
                  json.dumps(progress) if progress else "",
                  encode_outcome(outcome) if cacheable else ""],
        )
        if not written and cacheable:
            self.redis.set(self.result_key(key), encode_outcome(outcome), ex=self.ttl_s, nx=True)
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
