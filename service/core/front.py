"""The front of the run layer: request hashes, the body memo, the cache, single-flight,
job views and the frontier (one cached solve per budget), the same over either executor.

Every solver call is identified by a request hash (``tasks``). A call goes: this
process's flights (an identical call already waited on here: join it) -> the store
(answered before: serve it) -> ``Executor.ensure`` (join the run under way, in this
process or, in cluster mode, anywhere; else start one) -> ``Executor.wait``. A
flight ends only after the executor has recorded the outcome, so a caller either
joins the run or finds its answer: identical requests never solve twice.

A job is the same run, also recorded as a job under its request hash.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.graph_text import GraphText
from optiremat.service.core.job_views import decode_cursor, encode_cursor, job_summary, job_view
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.models import Readiness
from optiremat.service.core.outcome import (
    BudgetRange,
    Cancelled,
    Infeasible,
    Interrupted,
    Outcome,
    Solved,
    reusable,
)
from optiremat.service.core.runs import (
    ANONYMOUS,
    Executor,
    JobRecord,
    in_thread,
    job_status,
)
from optiremat.service.core.tasks import BudgetRangeTask, SolveTask, Task
from optiremat.solver.frontier import FrontierResult, frontier_of, point_fields, spaced_budgets
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions
from optiremat.solver.wire import (
    Frontier,
    FrontierPoint,
    Job,
    JobPage,
    JobStatus,
)

T = TypeVar("T")
BODY_MEMO_SIZE = 4096  # body digests remembered; 100 bytes each
# When stopping, waiting requests are answered this long before the grace ends: time
# for the answers to go out before the server cuts what is still open.
_ANSWER_BEFORE_S = 1.0


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


def _submitter(owner: str | None) -> str:
    return ANONYMOUS if owner is None else owner


class Front:
    def __init__(self, executor: Executor, metrics: Metrics) -> None:
        self._executor = executor
        self._store = executor.store
        self._metrics = metrics
        self._flights: dict[str, asyncio.Future[Outcome]] = {}
        self._flying: dict[str, asyncio.Task[None]] = {}  # the task resolving each flight
        self._waiters: dict[str, int] = {}  # clients waiting on each flight
        self._tasks: set[asyncio.Task[None]] = set()
        self._body_keys = BodyMemo()
        self._draining = False

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        return await in_thread(self._store, fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        await self._executor.start()

    async def stop(self) -> None:
        """Stop the executor; whoever still waits here is told the server stopped."""
        await self._executor.stop()
        self._interrupt_waiters()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def drain(self, grace_s: float) -> None:
        """The server is stopping (SIGTERM) and answers what is open within ``grace_s``:
        not ready from now on, and whoever still waits on a solve when the grace is
        nearly over is answered that the server stopped (503), not cut off."""
        self._draining = True
        asyncio.get_running_loop().call_later(max(0.0, grace_s - _ANSWER_BEFORE_S),
                                              self._interrupt_waiters)

    def _interrupt_waiters(self) -> None:
        for future in self._flights.values():
            if not future.done():
                future.set_result(Interrupted())

    async def readiness(self) -> Readiness:
        if self._draining:
            raise Unavailable("Not ready", "the server is shutting down")
        return await self._executor.readiness()

    # ---- answers --------------------------------------------------------------

    def _flight(self, task: Task, graph: GraphText, client: str) -> asyncio.Future[Outcome]:
        future = self._flights.get(task.key)
        if future is not None:
            self._metrics.coalesced.inc()
            return future
        future = asyncio.get_running_loop().create_future()
        # Retrieve an exception nobody awaited (every client hung up) so it is not logged.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._flights[task.key] = future
        self._flying[task.key] = self._spawn(self._fly(task, graph, client, future))
        return future

    async def _fly(self, task: Task, graph: GraphText, client: str,
                   future: asyncio.Future[Outcome]) -> None:
        try:
            outcome = await self._resolve(task, graph, client)
            if not future.done():
                future.set_result(outcome)
        except Exception as exc:  # e.g. the store is down: every waiter hears it
            if not future.done():
                future.set_exception(exc)
        finally:
            if self._flights.get(task.key) is future:
                del self._flights[task.key]
                del self._flying[task.key]

    async def _resolve(self, task: Task, graph: GraphText, client: str) -> Outcome:
        outcome = await self._stored_or_run(task, graph, client)
        if isinstance(outcome, Cancelled):
            # Cancelled under a waiter: everyone before it let the run go (they hung up)
            # just as this one came. Run it again, once.
            outcome = await self._stored_or_run(task, graph, client)
        return outcome

    async def _stored_or_run(self, task: Task, graph: GraphText, client: str) -> Outcome:
        stored = await self._read(self._store.get_answer, task.key)
        if stored is not None:
            self._metrics.cache_hits.inc()
            return stored
        if await self._executor.ensure(task, graph, job=False, client=client):
            self._metrics.coalesced.inc()  # a run this process did not start
        outcome = await self._executor.wait(task.key)
        assert outcome is not None
        return outcome

    async def _answer(self, task: Task, graph: GraphText, client: str) -> Outcome:
        """The task's outcome, waited for in its flight. When the last client waiting
        on a flight leaves (it hung up), the run is let go: it stops unless someone
        else still wants it (a job's submission, a waiter on another replica)."""
        key = task.key
        future = self._flight(task, graph, client)
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            # shield: one client leaving must not cancel a run others wait on
            return await asyncio.shield(future)
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]
                if not future.done():
                    self._let_go(key, future)

    def _let_go(self, key: str, future: asyncio.Future[Outcome]) -> None:
        fly = None
        if self._flights.get(key) is future:  # the next client starts a flight afresh
            del self._flights[key]
            fly = self._flying.pop(key)
            fly.cancel()  # it no longer waits (on Redis: no longer counts as waiting)
        future.cancel()

        async def abandon() -> None:
            if fly is not None:  # its wait has ended before anyone asks who still waits
                await asyncio.gather(fly, return_exceptions=True)
            with contextlib.suppress(Unavailable):  # the store is down: the run goes on
                if await self._executor.abandon(key):
                    self._metrics.abandoned.inc()

        self._spawn(abandon())

    async def solve(self, graph: GraphText, budget_bytes: int, options: SolveOptions,
                    *, body_digest: bytes | None = None, client: str = "") -> Outcome:
        """The answer for this request; ``body_digest`` lets ``stored_answer`` find it
        again from the raw body alone. ``client`` (who asks: an API key's id or an
        address) waits its turn at the workers (``fair_queue``)."""
        task = SolveTask(graph_hash=graph.content_hash, budget_bytes=budget_bytes,
                         options=options)
        if body_digest is not None:
            self._body_keys.remember(body_digest, task.key)
        return await self._answer(task, graph, client)

    async def stored_answer(self, body_digest: bytes) -> Outcome | None:
        """The stored answer for a body ``solve`` has seen, without parsing it again."""
        key = self._body_keys.key_for(body_digest)
        if key is None:
            return None
        stored = await self._read(self._store.get_answer, key)
        if stored is not None:
            self._metrics.cache_hits.inc()
        return stored

    async def frontier(self, graph: GraphText, budgets: list[int] | None, count: int | None,
                       options: SolveOptions, step_seconds: float | None = None,
                       client: str = "") -> Frontier | Outcome:
        """The frontier, or the outcome that stopped it (cancelled, interrupted, failed);
        ``step_seconds`` is the graph's ``own_step_seconds``.

        Each point is one ``solve``, so it is cached and single-flight like
        ``POST /v1/solve``.
        """
        low = high = None
        if budgets is None:
            assert count is not None
            task = BudgetRangeTask(graph_hash=graph.content_hash, tie=options.tie,
                                   offload=options.offload)
            span = await self._answer(task, graph, client)
            if not isinstance(span, BudgetRange):
                return span
            low, high = span.min_feasible_budget, span.max_useful_budget
            budgets = spaced_budgets(low, high, count)
        budgets = sorted(set(budgets))
        outcomes = await asyncio.gather(*(self.solve(graph, b, options, client=client)
                                          for b in budgets))
        points = []
        for budget, outcome in zip(budgets, outcomes, strict=True):
            if isinstance(outcome, Infeasible):
                result: FrontierResult = InfeasibleBudgetError(budget, outcome.min_budget_bytes)
            elif isinstance(outcome, Solved):
                result = Solution.model_validate_json(outcome.solution_json)
            else:
                return outcome
            points.append(FrontierPoint(**point_fields(budget, result)))
        return frontier_of(graph.content_hash, step_seconds, options, points, low, high)

    # ---- jobs -----------------------------------------------------------------
    # A job is one run per request hash, and a submission per owner (an API key's id,
    # ANONYMOUS with keys off): each owner sees its own submission (when it submitted,
    # whether it cancelled), cancelling withdraws only that owner's, and the run stops
    # when nothing wants it any more.

    async def submit_job(self, graph: GraphText, budget_bytes: int, options: SolveOptions,
                         owner: str | None = None, client: str = "") -> Job:
        """``owner``'s submission of the job for this request, from now (renewed if it
        had cancelled it); the run is started when there is none or it failed or was
        cancelled, else joined."""
        task = SolveTask(graph_hash=graph.content_hash, budget_bytes=budget_bytes,
                         options=options)
        record = await self._read(self._store.get_job, task.key)
        if record is None or not reusable(record.outcome):
            await self._executor.ensure(task, graph, job=True, client=client)
        await self._read(self._store.submit, task.key, _submitter(owner))
        record = await self._read(self._store.get_job, task.key, owner)
        assert record is not None, "ensure(job=True) records the job"
        return await self._view(record)

    async def list_jobs(self, owner: str | None, status: JobStatus | None, limit: int,
                        cursor: str | None = None) -> JobPage:
        """Jobs newest first (``owner``'s submissions only, unless None). Raises
        ``ValueError`` for a cursor this server did not hand out."""
        after = None if cursor is None else decode_cursor(cursor)
        records, position = await self._read(self._store.list_jobs, owner, status, after,
                                             limit)
        summaries = []
        for record in records:
            record, outcome, running = await self._live(record)
            summaries.append(job_summary(record, job_status(outcome, running,
                                                            record.withdrawn)))
        return JobPage(jobs=summaries,
                       next_cursor=None if position is None else encode_cursor(position))

    async def get_job(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job as ``owner`` submitted it; None when it did not (another key's job
        looks absent)."""
        record = await self._read(self._store.get_job, job_id, owner)
        return None if record is None else await self._view(record)

    async def cancel_job(self, job_id: str, owner: str | None = None,
                         wait_s: float = 5.0) -> Job | None:
        """Withdraw ``owner``'s submission (every one with keys off); the run is
        cancelled, and waited for briefly, when nothing else wants it."""
        record = await self._read(self._store.get_job, job_id, owner)
        if record is None:
            return None
        if record.outcome is None and not record.withdrawn:
            still_wanted = await self._read(self._store.withdraw, job_id, owner)
            if (not still_wanted and not self._waiters.get(job_id)
                    and await self._executor.abandon(job_id)):
                await self._read(self._store.stopped_for, job_id, owner)
                with contextlib.suppress(Unavailable):  # the store went away: as it is
                    await self._executor.wait(job_id, timeout_s=wait_s)
        return await self.get_job(job_id, owner)

    async def _live(self, record: JobRecord) -> tuple[JobRecord, Outcome | None, bool]:
        """(record, outcome, running): while unfinished, the live run is the truth."""
        if record.outcome is not None:
            return record, record.outcome, False
        live = await self._executor.live(record.key)
        if live.progress is not None:
            record = replace(record, progress=live.progress)
        return record, live.outcome, live.running

    async def _view(self, record: JobRecord) -> Job:
        return job_view(*await self._live(record))
