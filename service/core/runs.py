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
from enum import IntEnum
from typing import Any, Protocol, TypeVar

from optiremat.service.core.errors import Unavailable
from optiremat.service.core.graph_text import GraphText
from optiremat.service.core.models import Readiness
from optiremat.service.core.outcome import Answer, Outcome
from optiremat.service.core.tasks import SolveTask, Task
from optiremat.solver.wire import JobStatus, Progress

T = TypeVar("T")


ANONYMOUS = ""
"""The one owner of every job submitted with API keys off."""


class Withdrawal(IntEnum):
    """Where an owner's submission of a job stands (``DELETE /v1/jobs/{id}``)."""

    NONE = 0  # it wants the run
    LEFT = 1  # withdrawn while the run went on for others: it shows nothing of the run
    STOPPED = 2  # withdrawn, and the run stopped for it: it shows how the run ended


@dataclass(frozen=True)
class JobRecord:
    """A job as its store keeps it; ``outcome`` is None until it has finished, and
    ``started`` says whether a worker has taken it meanwhile. Read for an owner, it is
    that owner's submission: ``created_at`` is when it submitted, ``withdrawn`` whether
    it has cancelled since (``Withdrawal``)."""

    key: str
    task: SolveTask
    created_at: float
    updated_at: float
    outcome: Outcome | None
    progress: Progress | None
    started: bool = False
    withdrawn: Withdrawal = Withdrawal.NONE

    @property
    def status(self) -> JobStatus:
        """The status the store knows of (the live run may know better)."""
        return job_status(self.outcome, self.started, self.withdrawn)


Position = tuple[float, str]
"""Where a job stands in a listing, newest first: (created_at, key)."""


def shows_run(withdrawn: Withdrawal, outcome: Outcome | None) -> bool:
    """Whether a submission so withdrawn shows the run, that ended so (None: not yet)."""
    return withdrawn == Withdrawal.NONE or (withdrawn == Withdrawal.STOPPED
                                            and outcome is not None)


def job_status(outcome: Outcome | None, running: bool = False,
               withdrawn: Withdrawal = Withdrawal.NONE) -> JobStatus:
    """The status of a job that ended so, or, unfinished, is ``running`` or not; as
    the submission sees it, withdrawn so."""
    if not shows_run(withdrawn, outcome):
        return JobStatus.CANCELLED
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

    def get_job(self, key: str, owner: str | None = None) -> JobRecord | None:
        """The job; with ``owner``, as that owner submitted it, and None when it did not.
        Without, ``withdrawn`` is the ``ANONYMOUS`` submission's."""

    def submit(self, key: str, owner: str) -> None:
        """``owner``'s submission of the (recorded) job, from now; one it had withdrawn
        is submitted afresh."""

    def withdraw(self, key: str, owner: str | None) -> bool:
        """Withdraw ``owner``'s submission of the job (every one when None): ``LEFT``;
        whether a submission not withdrawn remains."""

    def stopped_for(self, key: str, owner: str | None) -> None:
        """The run stopped for ``owner``'s withdrawal (every one's when None): ``STOPPED``."""

    def wanted(self, key: str) -> bool:
        """Whether a submission of the job is not withdrawn."""

    def list_jobs(self, owner: str | None, status: JobStatus | None, after: Position | None,
                  limit: int) -> tuple[list[JobRecord], Position | None]:
        """Jobs newest first, after ``after``: ``owner``'s submissions (every job when
        None), with ``status`` (any when None); at most ``limit``, and where the next
        page starts (None on the last one)."""

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

    async def ensure(self, task: Task, graph: GraphText, *, job: bool,
                     client: str = "") -> bool:
        """Start the task's run unless one is under way or has answered; with ``job``
        the run is (also) a job, else a client waits on it (the sync lane); ``client``
        takes its turn with other clients'. True when it joined a run under way."""

    async def wait(self, key: str, timeout_s: float | None = None) -> Outcome | None:
        """How the run ends, once recorded; None if ``timeout_s`` passes first."""

    async def live(self, key: str) -> Live: ...

    async def cancel(self, key: str) -> None:
        """Drop the run if queued, or ask its solver to stop and keep its best plan."""

    async def abandon(self, key: str) -> bool:
        """No client in this process waits on the run any more: cancel it unless
        something still wants it (a job submission not withdrawn; in cluster mode a
        client waiting on another replica). True when it was cancelled."""
