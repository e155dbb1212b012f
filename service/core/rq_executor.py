"""The cluster backend: API replicas that queue solves on Redis for RQ workers.

Same contract as the embedded ``SolveManager``. A request goes: this process's
in-flight map (an identical request already waited on here: join it) -> the
result cache in Redis -> ``ClusterStore.ensure_run``, which joins the run another
replica started or queues a new one (the request hash is the RQ job id) -> wait
until the run's record in Redis has an outcome. Workers write outcomes; an API
replica holds no state that a restart could lose.

Waiting is polling, quick at first and then every ``_MAX_POLL_S``; every
``_LIVE_CHECK_S`` the wait also asks RQ whether the run is still alive, so a run
whose worker died without retries left comes back failed instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from optiremat.service.api.models import Job, JobStatus, Readiness
from optiremat.service.api.problems import ProblemError
from optiremat.service.core.config import Settings
from optiremat.service.core.front import BodyMemo, budget_range_key, job_fields, job_view, solve_key
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.pool import Interrupted, Outcome
from optiremat.service.core.redis_store import ClusterStore, RunRecord
from optiremat.service.core.store import JobRecord
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import SolveOptions

log = logging.getLogger("optiremat.service")
T = TypeVar("T")

_FIRST_POLL_S = 0.005
_MAX_POLL_S = 0.2
_LIVE_CHECK_S = 1.0
# A wait rides out a Redis restart this long before answering 503: the solve goes on.
_REDIS_OUTAGE_S = 30.0


def _unavailable(exc: BaseException) -> ProblemError:
    return ProblemError(503, "Store unavailable",
                        f"Redis does not answer ({type(exc).__name__}: {exc}); retry shortly",
                        headers={"Retry-After": "5"})


class ClusterManager:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        assert settings.redis_url
        self._settings = settings
        self._metrics = metrics
        self._redis = Redis.from_url(settings.redis_url, health_check_interval=30)
        self._store = ClusterStore(self._redis, settings.result_ttl_s, settings.job_retries)
        self._inflight: dict[str, asyncio.Future[Outcome]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._body_keys = BodyMemo()

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A blocking store call in a thread; Redis being down is a 503."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except RedisError as exc:
            raise _unavailable(exc) from exc

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        self._spawn(self._reap_forever())

    async def stop(self) -> None:
        """Stop waiting (waiters get 503 and may retry); the solves go on in the workers."""
        for future in self._inflight.values():
            if not future.done():
                future.set_result(Interrupted())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._redis.close()

    async def readiness(self) -> Readiness:
        try:
            await asyncio.to_thread(self._store.ping)
            workers = await asyncio.to_thread(self._store.worker_count)
            queue_depth = await asyncio.to_thread(lambda: self._store.queue.count)
        except RedisError as exc:
            raise ProblemError(503, "Not ready", f"Redis does not answer: {exc}") from exc
        return Readiness(workers=workers, queue_depth=queue_depth)

    async def _reap_forever(self) -> None:
        period = self._settings.worker_heartbeat_s
        while True:
            try:
                queued, running = await asyncio.to_thread(self._store.reap, 0.9 * period)
                self._metrics.queue_depth.set(queued)
                self._metrics.busy_workers.set(running)
            except RedisError as exc:
                log.warning("reaper: Redis does not answer: %s", exc)
            except Exception:  # keep reaping whatever one round hit
                log.exception("reaper round failed")
            await asyncio.sleep(period)

    # ---- runs -------------------------------------------------------------------

    async def _ensure(self, key: str, kind: str, graph: CostGraph, spec: dict[str, Any],
                      payload: dict[str, Any], *, time_limit_s: float,
                      as_job: bool) -> RunRecord:
        graph_hash = graph.content_hash
        if not await self._call(self._store.has_graph, graph_hash):
            graph_json = await asyncio.to_thread(graph.canonical_json)  # MBs: off the loop
            await self._call(self._store.put_graph, graph_hash, graph_json)
        record, started = await self._call(
            self._store.ensure_run, key, kind, spec, {**payload, "graph_hash": graph_hash},
            time_limit_s=time_limit_s, as_job=as_job)
        if started:
            log.info("queued %s %s", kind, key)
        elif record.outcome is None:
            self._metrics.coalesced.inc()  # another replica's request is solving it
        return record

    def _run(self, key: str, kind: str, graph: CostGraph, spec: dict[str, Any],
             payload: dict[str, Any], time_limit_s: float) -> asyncio.Future[Outcome]:
        future = self._inflight.get(key)
        if future is not None:
            self._metrics.coalesced.inc()
            return future
        future = asyncio.get_running_loop().create_future()
        # Retrieve an exception nobody awaited (every client hung up) so it is not logged.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._inflight[key] = future

        async def drive() -> None:
            try:
                outcome = await self._resolve(key, kind, graph, spec, payload, time_limit_s)
                if not future.done():
                    future.set_result(outcome)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            finally:
                if self._inflight.get(key) is future:
                    del self._inflight[key]

        self._spawn(drive())
        return future

    async def _resolve(self, key: str, kind: str, graph: CostGraph, spec: dict[str, Any],
                       payload: dict[str, Any], time_limit_s: float) -> Outcome:
        stored = await self._call(self._store.get_result, key)
        if stored is not None:
            self._metrics.cache_hits.inc()
            return stored
        record = await self._ensure(key, kind, graph, spec, payload,
                                    time_limit_s=time_limit_s, as_job=False)
        if record.outcome is not None:
            return record.outcome
        outcome = await self._wait(key)
        assert outcome is not None
        return outcome

    async def _wait(self, key: str, timeout_s: float | None = None) -> Outcome | None:
        """The run's outcome once it has one; None if ``timeout_s`` passes first."""
        now = time.monotonic()
        deadline = None if timeout_s is None else now + timeout_s
        next_live_check = now + _LIVE_CHECK_S
        outage_since: float | None = None
        delay = _FIRST_POLL_S
        while True:
            try:
                outcome = await asyncio.to_thread(self._store.outcome, key)
                if outcome is None and time.monotonic() >= next_live_check:
                    outcome = (await asyncio.to_thread(self._store.live, key)).outcome
                    next_live_check = time.monotonic() + _LIVE_CHECK_S
                outage_since = None
            except (RedisConnectionError, RedisTimeoutError) as exc:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > _REDIS_OUTAGE_S:
                    raise _unavailable(exc) from exc
                outcome, delay = None, _MAX_POLL_S
            except RedisError as exc:
                raise _unavailable(exc) from exc
            if outcome is not None:
                return outcome
            if deadline is not None and time.monotonic() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_POLL_S)

    # ---- synchronous use --------------------------------------------------------

    async def solve(self, graph: CostGraph, budget_bytes: int, options: SolveOptions,
                    *, body_digest: bytes | None = None) -> Outcome:
        key = solve_key(graph.content_hash, budget_bytes, options)
        if body_digest is not None:
            self._body_keys.remember(body_digest, key)
        spec, payload = _solve_spec(graph, budget_bytes, options)
        future = self._run(key, "solve", graph, spec, payload, options.time_limit_s)
        # shield: a client that hangs up must not cancel a run others may be waiting on
        return await asyncio.shield(future)

    async def stored_answer(self, body_digest: bytes) -> Outcome | None:
        key = self._body_keys.key_for(body_digest)
        if key is None:
            return None
        stored = await self._call(self._store.get_result, key)
        if stored is not None:
            self._metrics.cache_hits.inc()
        return stored

    async def budget_range(self, graph: CostGraph, tie: bool) -> Outcome:
        key = budget_range_key(graph.content_hash, tie)
        spec = {"graph_hash": graph.content_hash, "tie": tie}
        # min_feasible_budget runs CP-SAT under SolveOptions' default time limit
        time_limit_s = SolveOptions().time_limit_s
        future = self._run(key, "budget_range", graph, spec, {"tie": tie}, time_limit_s)
        return await asyncio.shield(future)

    # ---- jobs -------------------------------------------------------------------

    async def submit_job(self, graph: CostGraph, budget_bytes: int,
                         options: SolveOptions) -> Job:
        key = solve_key(graph.content_hash, budget_bytes, options)
        spec, payload = _solve_spec(graph, budget_bytes, options)
        record = await self._ensure(key, "solve", graph, spec, payload,
                                    time_limit_s=options.time_limit_s, as_job=True)
        return await self._view(record)

    async def get_job(self, job_id: str) -> Job | None:
        record = await self._call(self._store.get_run, job_id)
        if record is None or not record.job:
            return None
        return await self._view(record)

    async def cancel_job(self, job_id: str, wait_s: float = 5.0) -> Job | None:
        """Flag the run wherever it is solving and wait (briefly) for it to settle."""
        record = await self._call(self._store.get_run, job_id)
        if record is None or not record.job:
            return None
        if record.outcome is None:
            await self._call(self._store.cancel, job_id, record.generation)
            with contextlib.suppress(ProblemError):  # Redis gone: report the job as it is
                await self._wait(job_id, timeout_s=wait_s)
        return await self.get_job(job_id)

    async def _view(self, record: RunRecord) -> Job:
        status: JobStatus | None = None
        outcome = record.outcome
        if outcome is None:
            live = await self._call(self._store.live, record.key)
            if live.outcome is None:
                status = JobStatus.RUNNING if live.running else JobStatus.QUEUED
            outcome = live.outcome
        solution_json = error = None
        if outcome is not None:
            status, solution_json, error = job_fields(outcome)
        assert status is not None
        return job_view(JobRecord(
            id=record.key, status=status, spec=record.spec, solution_json=solution_json,
            error=error, progress=record.progress, created_at=record.created_at,
            updated_at=record.updated_at,
        ))


def _solve_spec(graph: CostGraph, budget_bytes: int,
                options: SolveOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's spec (as the embedded store keeps it) and the worker's payload."""
    options_json = options.model_dump(mode="json")
    spec = {"graph_hash": graph.content_hash, "budget_bytes": budget_bytes,
            "options": options_json}
    return spec, {"budget_bytes": budget_bytes, "options": options_json}
