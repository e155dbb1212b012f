"""Worker processes that run tasks so the event loop never blocks.

Each worker is a long-lived spawned process (warm imports) with its own pipe and
its own cancel ``Event``: setting the event reaches the solve running there, and
the solver returns its best incumbent. A worker that dies is replaced; the task
it held fails with a clear message. Tasks wait in a ``FairQueue``: the ``size``
workers take sync runs before jobs, the ``sync_size`` more take sync runs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event

from optiremat.service.core.fair_queue import FairQueue
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.outcome import (
    Cancelled,
    Failed,
    Infeasible,
    Interrupted,
    Outcome,
    Solved,
    TaskResult,
)
from optiremat.service.core.pool_worker import Ready, worker_main
from optiremat.service.core.tasks import Lane, SolveTask, Task
from optiremat.solver.wire import Progress

log = logging.getLogger("optiremat.service")


@dataclass(eq=False)
class PoolTask:
    task: Task
    graph_json: str
    lane: Lane = Lane.SYNC
    client: str = ""  # whose turn it waits for (fair_queue)
    on_progress: Callable[[Progress], None] | None = None
    on_start: Callable[[], None] | None = None  # when a worker takes it
    future: asyncio.Future[Outcome] = field(init=False)
    cancel_requested: bool = field(default=False, init=False)
    worker: _Worker | None = field(default=None, init=False)

    @property
    def running(self) -> bool:
        return self.worker is not None


class _Worker:
    def __init__(self, index: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe in a threaded server
        self.conn, child = ctx.Pipe()
        self.cancel: Event = ctx.Event()
        self.process: SpawnProcess = ctx.Process(
            target=worker_main, args=(child, self.cancel),
            name=f"optiremat-worker-{index}", daemon=True,
        )
        self.process.start()
        child.close()
        self.ready = False  # until it reports its imports done

    def stop_nowait(self) -> None:
        self.cancel.set()
        with contextlib.suppress(OSError):  # already gone
            self.conn.send(None)

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():  # it ignores SIGTERM (pool_worker): kill it
            self.process.kill()
            self.process.join()
        self.conn.close()


class WorkerPool:
    def __init__(self, size: int, metrics: Metrics, sync_size: int = 0) -> None:
        self.size = size + sync_size
        # slot -> the lanes its worker serves, in order
        self._lanes = [(Lane.SYNC, Lane.BACKGROUND)] * size + [(Lane.SYNC,)] * sync_size
        self._metrics = metrics
        self._queue: FairQueue[PoolTask] = FairQueue()
        self._workers: list[_Worker] = []
        self._slots: list[asyncio.Task[None]] = []
        self._running: set[PoolTask] = set()
        # One thread per worker does the blocking pipe I/O.
        self._io = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="optiremat-pipe")
        self._stopping = False

    async def start(self) -> None:
        self._workers = [_Worker(i) for i in range(self.size)]
        self._slots = [asyncio.create_task(self._serve(i)) for i in range(self.size)]

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        """Tasks a worker is on."""
        return len(self._running)

    @property
    def ready_workers(self) -> int:
        return sum(w.ready and w.process.is_alive() for w in self._workers)

    def submit(self, task: PoolTask) -> asyncio.Future[Outcome]:
        task.future = asyncio.get_running_loop().create_future()
        if self._stopping:
            task.future.set_result(Interrupted())
            return task.future
        self._queue.put(task, task.lane, task.client)
        self._metrics.queue_depth.set(self._queue.qsize())
        return task.future

    def cancel(self, task: PoolTask) -> None:
        """Cancel a queued task at once; ask a running one to stop and keep its incumbent."""
        if task.future.done():
            return
        task.cancel_requested = True
        if task.worker is not None:
            task.worker.cancel.set()
        else:  # still queued: the slot that dequeues it skips it
            task.future.set_result(Cancelled())

    async def _serve(self, slot: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._ready_worker(loop, slot)  # warm before taking work
            task = await self._queue.get(self._lanes[slot])
            self._metrics.queue_depth.set(self._queue.qsize())
            if task.future.done():
                continue
            worker = await self._ready_worker(loop, slot)  # it may have died while idle
            if task.future.done():  # cancelled while the worker restarted
                continue
            worker.cancel.clear()
            task.worker = worker
            if task.on_start is not None:
                task.on_start()
            self._running.add(task)
            self._metrics.busy_workers.inc()
            started = time.monotonic()
            try:
                result = await self._exchange(loop, worker, task)
            except (EOFError, OSError) as exc:
                await loop.run_in_executor(None, worker.join, 1.0)
                result = Failed(message=(
                    f"the worker process exited during the task (exit code "
                    f"{worker.process.exitcode}); the solver may have run out of memory"))
                log.error("worker %d died: %r", slot, exc)
                if not self._stopping:
                    self._respawn(slot)
            finally:
                self._running.discard(task)
                self._metrics.busy_workers.dec()
                task.worker = None
            if isinstance(task.task, SolveTask):
                self._record_solve(result, task.cancel_requested, time.monotonic() - started)
            if not task.future.done():
                task.future.set_result(Cancelled(partial=result) if task.cancel_requested
                                       else result)

    async def _ready_worker(self, loop: asyncio.AbstractEventLoop, slot: int) -> _Worker:
        """The slot's worker, replaced if it died, once it has imported the solver."""
        while True:
            worker = self._workers[slot]
            if not worker.process.is_alive():
                worker = self._respawn(slot)
            if worker.ready:
                return worker
            try:
                worker.ready = isinstance(
                    await loop.run_in_executor(self._io, worker.conn.recv), Ready)
            except (EOFError, OSError):
                log.error("worker %d exited while starting (exit code %s)", slot,
                          worker.process.exitcode)
                await asyncio.sleep(1.0)  # do not spin when every start fails

    async def _exchange(self, loop: asyncio.AbstractEventLoop, worker: _Worker,
                        task: PoolTask) -> TaskResult:
        await loop.run_in_executor(self._io, worker.conn.send, (task.task, task.graph_json))
        task.graph_json = ""  # the worker has it: MBs this process need not hold meanwhile
        while True:
            message = await loop.run_in_executor(self._io, worker.conn.recv)
            if isinstance(message, Progress):
                if task.on_progress is not None:
                    task.on_progress(message)
                continue
            result: TaskResult = message
            return result

    def _record_solve(self, result: TaskResult, cancelled: bool, seconds: float) -> None:
        if cancelled:
            outcome = "cancelled"
        elif isinstance(result, Solved):
            outcome = "solved"
        elif isinstance(result, Infeasible):
            outcome = "infeasible"
        elif isinstance(result, Failed) and result.invalid:
            outcome = "invalid"  # the request's fault, answered 422: no failure of a solve
        else:
            outcome = "failed"
        self._metrics.solves.labels(outcome=outcome).inc()
        self._metrics.solve_seconds.observe(seconds)

    def _respawn(self, slot: int) -> _Worker:
        self._workers[slot] = _Worker(slot)
        return self._workers[slot]

    async def stop(self, grace_s: float = 3.0) -> None:
        """Stop every worker; unfinished tasks resolve to ``Interrupted``."""
        self._stopping = True
        unfinished = set(self._running)
        for slot in self._slots:
            slot.cancel()
        await asyncio.gather(*self._slots, return_exceptions=True)
        self._slots.clear()  # their frames hold workers, whose Events must be freed below
        for worker in self._workers:
            worker.stop_nowait()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, w.join, grace_s)
                               for w in self._workers))
        self._workers.clear()  # frees the cancel Events' semaphores before the process exits
        unfinished.update(self._queue.drain())
        for task in unfinished:
            if not task.future.done():
                task.future.set_result(Interrupted())
        self._io.shutdown(wait=False, cancel_futures=True)
