"""What the front needs from the two ways of running solves.

An ``Executor`` runs tasks and records how each run ends; its ``store`` keeps the
answers and the jobs. The embedded one (``pool_executor.PoolExecutor``) runs them
in worker processes and records them in SQLite; the cluster one
(``rq_executor.RQExecutor``) queues them on Redis, where RQ workers run them and
record them themselves. Whoever runs a solve records its outcome; the front
(``front.Front``) only reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.models import Readiness
from optiremat.service.core.outcome import Answer, Outcome
from optiremat.service.core.tasks import SolveTask, Task
from optiremat.solver.graph import CostGraph
from optiremat.solver.wire import JobStatus, Progress

T = TypeVar("T")


@dataclass(frozen=True)
class JobRecord:
    """A job as its store keeps it; ``outcome`` is None until it has finished, and
    ``started`` says whether a worker has taken it meanwhile."""

    key: str
    task: SolveTask
    created_at: float
    updated_at: float
    outcome: Outcome | None
    progress: Progress | None
    started: bool = False

    @property
    def status(self) -> JobStatus:
        """The status the store knows of (the live run may know better)."""
        return job_status(self.outcome, self.started)


Position = tuple[float, str]
"""Where a job stands in a listing, newest first: (created_at, key)."""


def job_status(outcome: Outcome | None, running: bool = False) -> JobStatus:
    """The status of a job that ended so, or, unfinished, is ``running`` or not."""
    if outcome is None:
        return JobStatus.RUNNING if running else JobStatus.QUEUED
    if outcome.type == "solved":
        return JobStatus.SUCCEEDED
    if outcome.type == "cancelled":
        return JobStatus.CANCELLED
    return JobStatus.FAILED


@dataclass(frozen=True)
class Live:
    """Where an unfinished run stands: ``outcome`` once it has finished (or has been
    found dead), else whether a worker is on it and its latest progress."""

    outcome: Outcome | None
    running: bool = False
    progress: Progress | None = None


class Store(Protocol):
    """The reads the front makes. Blocking: the front calls them in a thread."""

    def ping(self) -> None: ...

    def get_answer(self, key: str) -> Answer | None: ...

    def get_job(self, key: str) -> JobRecord | None: ...

    def add_owner(self, job: JobRecord, owner: str) -> None:
        """List the job for this API key's id too."""

    def owns(self, owner: str, key: str) -> bool:
        """Whether this API key's id submitted the job (``add_owner``)."""

    def list_jobs(self, owner: str | None, status: JobStatus | None, after: Position | None,
                  limit: int) -> tuple[list[JobRecord], Position | None]:
        """Jobs newest first, after ``after``: those of ``owner`` (all when None), with
        ``status`` (any when None); at most ``limit``, and where the next page starts
        (None on the last one)."""

    def unavailable(self, exc: Exception) -> Unavailable | None:
        """``exc`` as a 503 when it means the store is down or full, else None."""


async def in_thread(store: Store, fn: Callable[..., T], *args: Any) -> T:
    """A blocking call on ``store`` in a thread: the event loop never waits on a disk or
    a socket, and the store being down or full is an ``Unavailable`` (a 503)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception as exc:
        unavailable = store.unavailable(exc)
        if unavailable is None:
            raise
        raise unavailable from exc


class Executor(Protocol):
    @property
    def store(self) -> Store: ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Release this process's resources; unfinished runs are left to resume."""

    async def readiness(self) -> Readiness:
        """Raises ``Unavailable`` when not ready."""

    async def ensure(self, task: Task, graph: CostGraph, *, job: bool) -> bool:
        """Start the task's run unless one is under way or has answered; with ``job``
        the run is (also) a job. True when it joined a run under way."""

    async def wait(self, key: str, timeout_s: float | None = None) -> Outcome | None:
        """How the run ends, once recorded; None if ``timeout_s`` passes first."""

    async def live(self, key: str) -> Live: ...

    async def cancel(self, key: str) -> None:
        """Drop the run if queued, or ask its solver to stop and keep its best plan."""
