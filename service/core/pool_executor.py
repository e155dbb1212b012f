"""The embedded executor: runs in this process's worker pool, records in SQLite.

A run is a pool task and a driver coroutine that awaits it and records the
outcome (the answer, and the job's end if it is a job) before it lets go of the
run, the way an RQ worker records what it ran in cluster mode. Jobs left
unfinished by a previous server process are run again at start. Writes go
through the ``StoreKeeper``, which holds what a full disk refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from optiremat.service.core.config import Settings
from optiremat.service.core.errors import Unavailable, queue_full
from optiremat.service.core.graph_text import GraphText
from optiremat.service.core.keeper import StoreKeeper
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.models import Readiness
from optiremat.service.core.outcome import Cancelled, Failed, Interrupted, Outcome, settled
from optiremat.service.core.pool import PoolTask, WorkerPool
from optiremat.service.core.runs import Live, in_thread
from optiremat.service.core.store import Evicted, SqliteStore
from optiremat.service.core.tasks import Lane, Task
from optiremat.solver.wire import Progress

log = logging.getLogger("optiremat.service")
T = TypeVar("T")


@dataclass(eq=False)
class _Run:
    task: Task
    future: asyncio.Future[Outcome]
    lane: Lane
    client: str
    cancel_requested: bool = False
    pool_task: PoolTask | None = None
    progress: Progress | None = None


class PoolExecutor:
    def __init__(self, store: SqliteStore, pool: WorkerPool, metrics: Metrics,
                 max_queued: int) -> None:
        self.store = store
        self._keeper = StoreKeeper(store)
        self._pool = pool
        self._metrics = metrics
        self._max_queued = max_queued
        self._runs: dict[str, _Run] = {}
        self._drivers: set[asyncio.Task[None]] = set()
        self._keeping: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics) -> PoolExecutor:
        def count(evicted: Evicted) -> None:
            metrics.store_evictions.labels(reason="ttl").inc(evicted.expired)
            metrics.store_evictions.labels(reason="size").inc(evicted.evicted)

        # first: a store it cannot read stops here
        store = SqliteStore(settings.database_path, max_bytes=settings.store_max_bytes,
                            ttl_s=settings.store_ttl_s, job_grace_s=settings.store_job_grace_s,
                            on_evict=count)
        metrics.store_bytes.set_function(store.disk_bytes)
        metrics.store_max_bytes.set(settings.store_max_bytes)
        return cls(store, WorkerPool(settings.workers, metrics, settings.sync_workers), metrics,
                   settings.max_queued_jobs)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """A store read (writes go through the keeper)."""
        return await in_thread(self.store, fn, *args)

    # ---- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start the workers and run again the jobs a previous process left unfinished."""
        await self._pool.start()
        for key, task, graph_json in await self._io(self.store.unfinished_jobs):
            if task.key != key:
                await self._keeper.record(key, Failed(
                    message="the solver was upgraded since this job was submitted; "
                            "submit the request again"), None)
                continue
            if not await self._io(self.store.wanted, key):  # it ran on for clients now gone
                await self._keeper.record(key, Cancelled(), None)
                continue
            self._start(task, graph_json)
            log.info("requeued job %s", key)
        self._keeping = asyncio.create_task(self._keeper.keep())

    async def stop(self) -> None:
        if self._keeping is not None:
            self._keeping.cancel()
            await asyncio.gather(self._keeping, return_exceptions=True)
        await self._pool.stop()
        await asyncio.gather(*self._drivers, return_exceptions=True)
        await self._keeper.flush()
        self.store.close()

    async def readiness(self) -> Readiness:
        try:
            await asyncio.to_thread(self.store.ping)
        except Exception as exc:
            raise Unavailable("Not ready", f"the result store does not answer: {exc}") from exc
        if self._keeper.fault is not None:
            raise Unavailable("Not ready",
                              f"the result store cannot be written: {self._keeper.fault}")
        pool = self._pool
        if pool.ready_workers < pool.size:
            raise Unavailable("Not ready",
                              f"{pool.ready_workers} of {pool.size} worker processes are ready")
        return Readiness(workers=pool.size, queue_depth=pool.queue_depth)

    # ---- runs ---------------------------------------------------------------

    async def ensure(self, task: Task, graph: GraphText, *, job: bool,
                     client: str = "") -> bool:
        if task.key not in self._runs:
            self._keeper.refuse_new_work()
            await self._check_queue(task)
        if job:
            assert task.kind == "solve"
            await self._keeper.write(self.store.put_job, task.key, task, graph.json)
        if task.key in self._runs:
            return True
        self._start(task, graph.json, Lane.BACKGROUND if job else Lane.SYNC, client)
        return False

    async def _check_queue(self, task: Task) -> None:
        """A new run past the bound on waiting ones is refused, unless it is answered."""
        queued = len(self._runs) - self._pool.running
        if queued < self._max_queued:
            return
        if await self._io(self.store.get_answer, task.key) is not None:
            return
        self._metrics.rejected.labels(reason="queue_full").inc()
        raise queue_full(queued, self._max_queued)

    def _start(self, task: Task, graph_json: str, lane: Lane = Lane.BACKGROUND,
               client: str = "") -> None:
        run = _Run(task, asyncio.get_running_loop().create_future(), lane, client)
        self._runs[task.key] = run
        driver = asyncio.create_task(self._drive(run, graph_json))
        self._drivers.add(driver)
        driver.add_done_callback(self._drivers.discard)

    def _mark_running(self, key: str) -> None:
        """A store write nobody waits for: a job's status for listings."""
        async def attempt() -> None:
            with contextlib.suppress(Unavailable):  # the store in fault: noted by the keeper
                await self._keeper.write(self.store.mark_running, key)

        task = asyncio.create_task(attempt())
        self._drivers.add(task)
        task.add_done_callback(self._drivers.discard)

    async def _drive(self, run: _Run, graph_json: str) -> None:
        try:
            outcome = await self._execute(run, graph_json)
        except Exception as exc:  # a store failure must not leave waiters hanging
            log.exception("run %s failed", run.task.key)
            outcome = Failed(message=f"internal error: {type(exc).__name__}: {exc}")
        if not isinstance(outcome, Interrupted):  # else left unfinished: it runs again
            await self._keeper.record(run.task.key, outcome, run.progress)
        run.future.set_result(outcome)
        del self._runs[run.task.key]

    async def _execute(self, run: _Run, graph_json: str) -> Outcome:
        stored = await self._io(self.store.get_answer, run.task.key)
        if stored is not None:
            return stored
        if run.cancel_requested:  # cancelled before it reached the queue
            return Cancelled()
        # No await between creating the task and queueing it: cancel sees either no
        # task (and the check above) or a task it can cancel.
        run.pool_task = PoolTask(run.task, graph_json, run.lane, run.client,
                                 on_progress=lambda report: setattr(run, "progress", report),
                                 on_start=lambda: self._mark_running(run.task.key))
        return settled(await self._pool.submit(run.pool_task))

    async def wait(self, key: str, timeout_s: float | None = None) -> Outcome | None:
        run = self._runs.get(key)
        if run is None:  # ended already: as recorded
            if (held := self._keeper.unrecorded(key)) is not None:
                return held
            record = await self._io(self.store.get_job, key)
            if record is not None and record.outcome is not None:
                return record.outcome
            return await self._io(self.store.get_answer, key)
        try:
            return await asyncio.wait_for(asyncio.shield(run.future), timeout_s)
        except TimeoutError:
            return None

    async def live(self, key: str) -> Live:
        run = self._runs.get(key)
        if run is None:  # ended, and recorded or held by the keeper
            return Live(self._keeper.unrecorded(key))
        return Live(None, running=run.pool_task is not None and run.pool_task.running,
                    progress=run.progress)

    async def cancel(self, key: str) -> None:
        run = self._runs.get(key)
        if run is None:
            return
        run.cancel_requested = True
        if run.pool_task is not None:
            self._pool.cancel(run.pool_task)

    async def abandon(self, key: str) -> bool:
        if key not in self._runs or await self._io(self.store.wanted, key):
            return False
        await self.cancel(key)
        return True
