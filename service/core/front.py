"""Cache, single-flight and jobs on top of the worker pool.

Every solver call is identified by a request hash. A call goes: in-flight map
(an identical call already running: wait for it) -> result store (answered
before: serve it) -> worker pool (solve, then store). The in-flight entry is
removed only after the result is stored, so a caller either joins the run or
finds the stored result: identical requests never solve twice.

A job is the same run with a row in the store whose id is the request hash.

``SolveManager`` is the embedded executor; ``rq_executor.ClusterManager`` is the
Redis one. Both answer the routes through ``executor.Executor``, and
share the pieces below that do not depend on where the solve runs (request hash,
job views, the frontier sweep, the body memo).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from optiremat.service.api.models import (
    Frontier,
    FrontierPoint,
    Job,
    JobStatus,
    Progress,
    Readiness,
)
from optiremat.service.api.problems import (
    INFEASIBLE_BUDGET,
    SOLVE_FAILED,
    Problem,
    ProblemError,
    problem_body,
)
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.pool import Cancelled, Interrupted, Outcome, Task, WorkerPool, settled
from optiremat.service.core.store import JobRecord, Store
from optiremat.service.core.worker import (
    BudgetRange,
    Failed,
    Infeasible,
    ProgressReport,
    Solved,
    solver_version,
)
from optiremat.solver.frontier import SweepResult, mark_pareto, point_fields, spaced_budgets
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions

if TYPE_CHECKING:
    from optiremat.service.core.executor import Executor

__all__ = ["SolveManager", "frontier", "job_fields", "job_view", "solve_key", "solver_version"]

log = logging.getLogger("optiremat.service")
BODY_MEMO_SIZE = 4096  # body digests remembered; 100 bytes each


def _digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def solve_key(graph_hash: str, budget_bytes: int, options: SolveOptions) -> str:
    """The request hash of a solve: job id, cache key and single-flight key."""
    return _digest({
        "kind": "solve",
        "graph_hash": graph_hash,
        "budget_bytes": budget_bytes,
        "options": options.model_dump(mode="json"),
        "solver_version": solver_version(),
    })


def budget_range_key(graph_hash: str, tie: bool) -> str:
    return _digest({"kind": "budget_range", "graph_hash": graph_hash, "tie": tie,
                    "solver_version": solver_version()})


def progress_dict(report: ProgressReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return Progress(incumbent_flops=report.incumbent_flops, bound_flops=report.bound_flops,
                    elapsed_s=report.elapsed_s).model_dump()


@dataclass(eq=False)
class _Run:
    key: str
    kind: str
    graph: CostGraph
    payload: dict[str, Any]  # task payload without the graph (added on a cache miss)
    future: asyncio.Future[Outcome]
    is_job: bool = False
    cancel_requested: bool = False
    task: Task | None = None
    progress: ProgressReport | None = None


def infeasible_problem(budget_bytes: int, min_budget_bytes: int) -> dict[str, Any]:
    return problem_body(
        422, "Infeasible budget",
        f"no plan keeps residuals within {budget_bytes} bytes; the smallest feasible "
        f"budget for this graph is {min_budget_bytes} bytes",
        type=INFEASIBLE_BUDGET, min_budget_bytes=min_budget_bytes,
    )


def job_fields(outcome: Outcome) -> tuple[JobStatus, str | None, dict[str, Any] | None]:
    """A finished run's job status, solution JSON and error problem."""
    if isinstance(outcome, Solved):
        return JobStatus.SUCCEEDED, outcome.solution_json, None
    if isinstance(outcome, Infeasible):
        return (JobStatus.FAILED, None,
                infeasible_problem(outcome.budget_bytes, outcome.min_budget_bytes))
    if isinstance(outcome, Cancelled):
        partial = outcome.partial
        return (JobStatus.CANCELLED,
                partial.solution_json if isinstance(partial, Solved) else None, None)
    message = outcome.message if isinstance(outcome, Failed) else repr(outcome)
    return JobStatus.FAILED, None, problem_body(500, "Solve failed", message, type=SOLVE_FAILED)


def job_view(record: JobRecord, *, status: JobStatus | None = None,
             progress: dict[str, Any] | None = None) -> Job:
    """The API's Job for a stored record; ``status`` and ``progress`` override the
    record's while the run is live."""
    progress = record.progress if progress is None else progress
    return Job(
        id=record.id,
        status=JobStatus(record.status) if status is None else status,
        graph_hash=record.spec["graph_hash"],
        budget_bytes=record.spec["budget_bytes"],
        options=SolveOptions.model_validate(record.spec["options"]),
        created_at=datetime.fromtimestamp(record.created_at, UTC),
        updated_at=datetime.fromtimestamp(record.updated_at, UTC),
        progress=None if progress is None else Progress.model_validate(progress),
        solution=None if record.solution_json is None
        else Solution.model_validate_json(record.solution_json),
        error=None if record.error is None else Problem.model_validate(record.error),
    )


class BodyMemo:
    """sha256 of a ``POST /v1/solve`` body -> its request hash, least recently used first.

    Lets a repeated body be answered from the store without parsing it again; sound
    because the request hash is a function of the body bytes (and of settings, fixed
    for the process).
    """

    def __init__(self, size: int = BODY_MEMO_SIZE) -> None:
        self._size = size
        self._keys: OrderedDict[bytes, str] = OrderedDict()

    def remember(self, body_digest: bytes, key: str) -> None:
        self._keys[body_digest] = key
        self._keys.move_to_end(body_digest)
        if len(self._keys) > self._size:
            self._keys.popitem(last=False)

    def key_for(self, body_digest: bytes) -> str | None:
        key = self._keys.get(body_digest)
        if key is not None:
            self._keys.move_to_end(body_digest)
        return key


class SolveManager:
    def __init__(self, store: Store, pool: WorkerPool, metrics: Metrics) -> None:
        self._store = store
        self._pool = pool
        self._metrics = metrics
        self._inflight: dict[str, _Run] = {}
        self._drivers: set[asyncio.Task[None]] = set()
        self._body_keys = BodyMemo()

    async def start(self) -> None:
        """Requeue the jobs a previous server process left unfinished."""
        for job_id, spec, graph_json in await asyncio.to_thread(self._store.unfinished_jobs):
            graph = CostGraph.model_validate_json(graph_json)
            options = SolveOptions.model_validate(spec["options"])
            if solve_key(graph.content_hash, spec["budget_bytes"], options) != job_id:
                await asyncio.to_thread(
                    self._store.update_job, job_id, JobStatus.FAILED,
                    error=problem_body(409, "Solver changed",
                                       "the solver was upgraded since this job was submitted; "
                                       "submit the request again", type=SOLVE_FAILED),
                )
                continue
            self._run_solve(graph, spec["budget_bytes"], options, as_job=True)
            log.info("requeued job %s", job_id)

    async def stop(self) -> None:
        await self._pool.stop()
        await asyncio.gather(*self._drivers, return_exceptions=True)
        self._store.close()

    async def readiness(self) -> Readiness:
        try:
            await asyncio.to_thread(self._store.ping)
        except Exception as exc:
            raise ProblemError(503, "Not ready",
                               f"the result store does not answer: {exc}") from exc
        pool = self._pool
        if pool.ready_workers < pool.size:
            raise ProblemError(503, "Not ready",
                               f"{pool.ready_workers} of {pool.size} worker processes are ready")
        return Readiness(workers=pool.size, queue_depth=pool.queue_depth)

    # ---- runs -------------------------------------------------------------

    def _run(self, key: str, kind: str, graph: CostGraph, payload: dict[str, Any],
             *, as_job: bool = False) -> _Run:
        run = self._inflight.get(key)
        if run is not None:
            self._metrics.coalesced.inc()
        else:
            run = _Run(key, kind, graph, payload, asyncio.get_running_loop().create_future())
            self._inflight[key] = run
            driver = asyncio.create_task(self._drive(run))
            self._drivers.add(driver)
            driver.add_done_callback(self._drivers.discard)
        run.is_job = run.is_job or as_job
        return run

    def _run_solve(self, graph: CostGraph, budget_bytes: int, options: SolveOptions,
                   *, as_job: bool = False) -> _Run:
        key = solve_key(graph.content_hash, budget_bytes, options)
        payload = {"budget_bytes": budget_bytes, "options": options.model_dump(mode="json")}
        return self._run(key, "solve", graph, payload, as_job=as_job)

    async def _drive(self, run: _Run) -> None:
        try:
            outcome = await self._resolve(run)
        except Exception as exc:  # a store failure must not leave waiters hanging
            log.exception("run %s failed", run.key)
            outcome = Failed(f"internal error: {type(exc).__name__}: {exc}")
        if run.is_job and not isinstance(outcome, Interrupted):
            await asyncio.to_thread(self._finish_job, run, outcome)
        run.future.set_result(outcome)
        del self._inflight[run.key]

    async def _resolve(self, run: _Run) -> Outcome:
        stored = await asyncio.to_thread(self._store.get_result, run.key)
        if stored is not None:
            self._metrics.cache_hits.inc()
            return stored
        graph_json = await asyncio.to_thread(run.graph.canonical_json)  # MBs: off the loop
        if run.cancel_requested:  # cancelled before it reached the queue
            return Cancelled(None)
        payload = {**run.payload, "graph_json": graph_json}
        # No await between creating the task and queueing it: cancel_job sees either
        # no task (and the check above) or a task it can cancel.
        run.task = Task(run.kind, payload,
                        on_progress=lambda report: setattr(run, "progress", report))
        outcome = settled(await self._pool.submit(run.task))
        if isinstance(outcome, Solved | Infeasible | BudgetRange):
            await asyncio.to_thread(self._store.put_result, run.key, outcome)
        return outcome

    # ---- synchronous use ----------------------------------------------------

    async def solve(self, graph: CostGraph, budget_bytes: int, options: SolveOptions,
                    *, body_digest: bytes | None = None) -> Outcome:
        """The answer for this request; ``body_digest`` lets ``stored_answer`` find it
        again from the raw body alone."""
        run = self._run_solve(graph, budget_bytes, options)
        if body_digest is not None:
            self._body_keys.remember(body_digest, run.key)
        # shield: a client that hangs up must not cancel a run others may be waiting on
        return await asyncio.shield(run.future)

    async def stored_answer(self, body_digest: bytes) -> Outcome | None:
        """The stored answer for a body ``solve`` has seen, without parsing it again."""
        key = self._body_keys.key_for(body_digest)
        if key is None:
            return None
        stored = await asyncio.to_thread(self._store.get_result, key)
        if stored is not None:
            self._metrics.cache_hits.inc()
        return stored

    async def budget_range(self, graph: CostGraph, tie: bool) -> Outcome:
        key = budget_range_key(graph.content_hash, tie)
        run = self._run(key, "budget_range", graph, {"tie": tie})
        return await asyncio.shield(run.future)

    # ---- jobs ---------------------------------------------------------------

    async def submit_job(self, graph: CostGraph, budget_bytes: int,
                         options: SolveOptions) -> Job:
        """The job for this request: the existing one, or a new (or restarted) one when
        there is none or it failed or was cancelled."""
        key = solve_key(graph.content_hash, budget_bytes, options)
        record = await asyncio.to_thread(self._store.get_job, key)
        if record is not None and record.status not in (JobStatus.FAILED, JobStatus.CANCELLED):
            return self._view(record)
        spec = {"graph_hash": graph.content_hash, "budget_bytes": budget_bytes,
                "options": options.model_dump(mode="json")}
        graph_json = await asyncio.to_thread(graph.canonical_json)
        await asyncio.to_thread(self._store.put_job, key, JobStatus.QUEUED, spec, graph_json)
        self._run_solve(graph, budget_bytes, options, as_job=True)
        record = await asyncio.to_thread(self._store.get_job, key)
        assert record is not None
        return self._view(record)

    async def get_job(self, job_id: str) -> Job | None:
        record = await asyncio.to_thread(self._store.get_job, job_id)
        return None if record is None else self._view(record)

    async def cancel_job(self, job_id: str, wait_s: float = 5.0) -> Job | None:
        """Cancel a queued or running job and wait (briefly) for it to settle."""
        run = self._inflight.get(job_id)
        if run is not None and run.is_job:
            run.cancel_requested = True
            if run.task is not None:
                self._pool.cancel(run.task)
            with contextlib.suppress(TimeoutError):  # still stopping: report it as it is
                await asyncio.wait_for(asyncio.shield(run.future), timeout=wait_s)
        return await self.get_job(job_id)

    def _view(self, record: JobRecord) -> Job:
        run = self._inflight.get(record.id)
        if run is not None and record.status in (JobStatus.QUEUED, JobStatus.RUNNING):
            # The live run is the truth while the job is unfinished.
            running = run.task is not None and run.task.running
            return job_view(record, status=JobStatus.RUNNING if running else JobStatus.QUEUED,
                            progress=progress_dict(run.progress))
        return job_view(record)

    def _finish_job(self, run: _Run, outcome: Outcome) -> None:
        status, solution_json, error = job_fields(outcome)
        self._store.update_job(run.key, status, solution_json=solution_json, error=error,
                               progress=progress_dict(run.progress))
        log.info("job %s finished: %s", run.key, type(outcome).__name__)


async def frontier(backend: Executor, graph: CostGraph, budgets: list[int] | None,
                   count: int | None, options: SolveOptions) -> Frontier | Outcome:
    """The sweep, or the outcome that stopped it (cancelled, interrupted, failed).

    Each point is one ``backend.solve``, so it is cached and single-flight like
    ``POST /v1/solve``, whichever backend runs it.
    """
    low = high = None
    if budgets is None:
        assert count is not None
        span = await backend.budget_range(graph, options.tie)
        if not isinstance(span, BudgetRange):
            return span
        low, high = span.min_feasible_budget, span.max_useful_budget
        budgets = spaced_budgets(low, high, count)
    budgets = sorted(set(budgets))
    outcomes = await asyncio.gather(*(backend.solve(graph, b, options) for b in budgets))
    points = []
    for budget, outcome in zip(budgets, outcomes, strict=True):
        if isinstance(outcome, Infeasible):
            result: SweepResult = InfeasibleBudgetError(budget, outcome.min_budget_bytes)
        elif isinstance(outcome, Solved):
            result = Solution.model_validate_json(outcome.solution_json)
        else:
            return outcome
        points.append(FrontierPoint(**point_fields(budget, result)))
    mark_pareto(points)
    return Frontier(graph_hash=graph.content_hash, options=options, min_feasible_budget=low,
                    max_useful_budget=high, points=points)


_mark_pareto = mark_pareto  # its name before the sweep moved to solver.frontier
