"""``optiremat worker``: a solver worker for cluster mode, on RQ.

The worker takes jobs from the Redis queue one at a time. RQ forks a work horse
per job from this process, which imported the solver once; the horse runs
``run_job``, which calls ``tasks.run_task`` (the very solve the embedded
pool runs) and records the outcome in Redis itself, so an answer never depends on
an API replica staying up.

While a job runs, a thread in the horse polls the job's cancel flag (feeding the
solver's cancel event) and writes progress; the worker process heartbeats
every ``OPTIREMAT_WORKER_HEARTBEAT_S``. A worker that dies stops heartbeating,
and the API replicas' reaper hands its job back to RQ: retried while
``OPTIREMAT_JOB_RETRIES`` lasts, else failed with the reason.

Imports neither FastAPI nor JAX.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Worker, get_current_job
from rq.exceptions import StopRequested
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from optiremat.service.core.config import Settings, redact_url
from optiremat.service.core.outcome import Cancelled, Failed, settled
from optiremat.service.core.redis_store import RedisStore, queue_name
from optiremat.service.core.tasks import TASKS, Lane, run_task
from optiremat.solver.wire import Progress

log = logging.getLogger("optiremat.worker")
HEARTBEATS_MISSED = 3  # a job is abandoned after its worker misses this many heartbeats
# While Redis is away: the first wait before trying again, doubling up to the last.
# 30 s at most: a restarted Redis is back to work within half a minute.
RECONNECT_FIRST_S = 1.0
RECONNECT_MAX_S = 30.0
# How long a finished solve waits for Redis to record it before the job fails (and is
# retried elsewhere): as long as the API waits for Redis on a synchronous request.
RECORD_PATIENCE_S = 30.0
_POLL_S = 0.1  # cancel flag and progress: how often the horse looks


class SolverWorker(Worker):
    """RQ's forking worker, with a heartbeat deadline of a few intervals.

    RQ's own deadline is the monitoring interval plus a minute, so a killed
    worker's job would sit in ``running`` for over a minute before anyone noticed.
    """

    # RQ's own wait between tries while Redis is away, inside its dequeue loop
    max_connection_wait_time = RECONNECT_MAX_S
    stop_requested = False  # SIGTERM or SIGINT came

    def get_heartbeat_ttl(self, job: RQJob, working_time: float = 0.0) -> int:
        return HEARTBEATS_MISSED * int(self.job_monitoring_interval)

    def let_go(self) -> None:
        """After its loop ended without Redis: stop its command listener, and wait for
        the solve it had forked, which records itself once Redis is back."""
        if self.pubsub_thread is not None:
            self.pubsub_thread.stop()
        if self._horse_pid:
            with contextlib.suppress(ChildProcessError):  # reaped already
                os.waitpid(self._horse_pid, 0)

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True
        super().request_stop(signum, frame)


def work(settings: Settings, *, burst: bool = False, sync_only: bool = False) -> int:
    """Run a worker until SIGTERM (which lets the current solve finish) or, with
    ``burst``, until the queues are empty. It takes sync runs before jobs; with
    ``sync_only``, nothing else (a lane clients waiting on a solve never lose to jobs).

    RQ rides out a Redis outage while it waits for a job, but quits its loop when
    Redis fails it anywhere else (a heartbeat, a registry's upkeep). So this
    process starts a new worker then, waiting between tries from ``RECONNECT_FIRST_S``,
    doubling to ``RECONNECT_MAX_S``: it stays up through an outage of any length
    and takes jobs again once Redis answers.
    """
    from optiremat.service.core.logs import configure_logging

    assert settings.redis_url, "cluster mode needs OPTIREMAT_REDIS_URL"
    configure_logging(settings.log_level)
    import optiremat.solver.solve  # noqa: F401  (every forked horse inherits the warm import)

    redis = Redis.from_url(settings.redis_url)
    # RQ takes from the first queue that has a job: sync runs first
    queues = [queue_name(Lane.SYNC)] + ([] if sync_only else [queue_name(Lane.BACKGROUND)])
    delay = RECONNECT_FIRST_S
    for attempt in itertools.count():
        worker: SolverWorker | None = None
        started = time.monotonic()
        try:
            # a fresh name after a restart: the last one may still be registered
            name = f"{socket.gethostname()}.{os.getpid()}" + (f".{attempt}" if attempt else "")
            worker = SolverWorker(queues, name=name, connection=redis,
                                  serializer=JSONSerializer,
                                  job_monitoring_interval=settings.worker_heartbeat_s,
                                  log_job_description=False)
            log.info("worker started", extra={"redis": redact_url(settings.redis_url),
                                              "queues": queues, "worker": name})
            worker.work(burst=burst, logging_level=settings.log_level.upper())
            reason = "it stopped"
        except RedisError as exc:
            reason = f"Redis does not answer ({type(exc).__name__}: {exc})"
        except StopRequested:  # SIGTERM while not on a job
            return 0
        if worker is not None:
            worker.let_go()  # a SIGTERM meanwhile reaches its handlers: asked again below
        if burst or (worker is not None and worker.stop_requested):
            return 0
        if time.monotonic() - started > RECONNECT_MAX_S:
            delay = RECONNECT_FIRST_S  # it had worked for a while: start the waits over
        log.warning("worker loop ended: %s; starting again in %.0f s", reason, delay)
        try:
            _sleep_unless_stopped(delay)
        except StopRequested:
            return 0
        delay = min(2 * delay, RECONNECT_MAX_S)
    return 0


class _Progress:
    """The solver's latest report; the solver calls ``report`` from its own threads."""

    def __init__(self) -> None:
        self.latest: Progress | None = None

    def report(self, report: Progress) -> None:
        self.latest = report  # one reference swap: no lock needed


def _watch(store: RedisStore, key: str, generation: str, cancel: threading.Event,
           progress: _Progress, done: threading.Event) -> None:
    written: Progress | None = None
    while not done.wait(_POLL_S):
        try:
            if not cancel.is_set() and store.cancel_requested(key):
                log.info("cancel requested", extra={"job": key})
                cancel.set()
            latest = progress.latest
            if latest is not None and latest is not written:
                store.update_live(key, generation, {"progress": latest.model_dump_json(),
                                                    "updated_at": time.time()})
                written = latest
        except RedisError as exc:  # a Redis blip must not stop the solve
            log.warning("cannot reach Redis while solving %s: %s", key, exc)


def _sleep_unless_stopped(seconds: float) -> None:
    """Sleep; SIGTERM or SIGINT meanwhile raises ``StopRequested`` (the handlers the
    last worker left would only note the request, and the next worker would not know)."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise StopRequested()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    time.sleep(seconds)


def _despite_outages(write: Callable[[], object]) -> None:
    """A solve's record, written through a Redis outage of up to ``RECORD_PATIENCE_S``
    (the solve is done: losing it to a restart of Redis would waste it)."""
    deadline = time.monotonic() + RECORD_PATIENCE_S
    delay = RECONNECT_FIRST_S
    while True:
        try:
            write()
            return
        except (RedisConnectionError, RedisTimeoutError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("cannot record the solve, Redis does not answer (%s); trying again "
                        "in %.0f s", exc, delay)
            time.sleep(delay)
            delay = min(2 * delay, RECONNECT_MAX_S)


def run_job(task_doc: dict[str, Any], key: str, generation: str, ttl_s: int) -> str:
    """The RQ job: run one task and record its outcome. Returns what happened."""
    job = get_current_job()
    assert job is not None, "run_job runs inside an RQ worker"
    store = RedisStore(job.connection, ttl_s)
    task = TASKS.validate_python(task_doc)
    record = store.get_run(key)
    if record is None or record.generation != generation or record.outcome is not None:
        # A retry of a run that finished after all, or one superseded by a newer run.
        log.info("job %s: nothing to do", key)
        return "skipped"
    if store.cancel_requested(key):
        store.finish(record, Cancelled())
        return "cancelled"
    graph_json = store.get_graph(task.graph_hash)
    if graph_json is None:
        store.finish(record, Failed(message=(
            "the graph was not in Redis when a worker took the job (evicted under memory "
            "pressure before the job was queued, or lost by Redis); submit the request again")))
        return "failed"
    store.update_live(key, generation, {"started_at": time.time(), "updated_at": time.time(),
                                        "worker": job.worker_name or "", "progress": ""})

    cancel, done, progress = threading.Event(), threading.Event(), _Progress()
    watcher = threading.Thread(target=_watch, name="optiremat-watch", daemon=True,
                               args=(store, key, generation, cancel, progress, done))
    watcher.start()
    started = time.monotonic()
    try:
        result = run_task(task, graph_json, cancel, progress.report)
    finally:
        done.set()
        watcher.join()
    outcome = settled(Cancelled(partial=result) if cancel.is_set() else result)
    _despite_outages(lambda: store.finish(record, outcome, progress=progress.latest))
    name = type(outcome).__name__.lower()
    log.info("task finished", extra={"job": key, "kind": task.kind, "outcome": name,
                                     "seconds": round(time.monotonic() - started, 3)})
    return name
