"""What the routes need from whatever runs the solves, and the choice between the two.

Embedded (the default): ``front.SolveManager`` with worker processes and SQLite in
this process. Cluster (``OPTIREMAT_REDIS_URL`` set): ``rq_executor.ClusterManager``,
which queues on Redis for ``optiremat worker`` processes anywhere. The API is the same either way.
"""

from __future__ import annotations

from typing import Protocol

from optiremat.service.api.models import Job, Readiness
from optiremat.service.core.config import Settings
from optiremat.service.core.metrics import Metrics
from optiremat.service.core.pool import Outcome
from optiremat.solver.graph import CostGraph
from optiremat.solver.solution import SolveOptions


class Executor(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Release this process's resources; solves elsewhere keep running."""

    async def readiness(self) -> Readiness:
        """Raises a 503 ``ProblemError`` when not ready."""

    async def solve(self, graph: CostGraph, budget_bytes: int, options: SolveOptions,
                    *, body_digest: bytes | None = None) -> Outcome: ...

    async def stored_answer(self, body_digest: bytes) -> Outcome | None: ...

    async def budget_range(self, graph: CostGraph, tie: bool) -> Outcome: ...

    async def submit_job(self, graph: CostGraph, budget_bytes: int,
                         options: SolveOptions) -> Job: ...

    async def get_job(self, job_id: str) -> Job | None: ...

    async def cancel_job(self, job_id: str, wait_s: float = 5.0) -> Job | None: ...


async def start_executor(settings: Settings, metrics: Metrics) -> Executor:
    executor: Executor
    if settings.redis_url:
        from optiremat.service.core.rq_executor import (
            ClusterManager,  # imports redis and rq only when used
        )

        executor = ClusterManager(settings, metrics)
    else:
        from optiremat.service.core.front import SolveManager
        from optiremat.service.core.pool import WorkerPool
        from optiremat.service.core.store import Store

        store = Store(settings.database_path)  # first: a store it cannot read stops here
        pool = WorkerPool(settings.workers, metrics)
        await pool.start()
        executor = SolveManager(store, pool, metrics)
    await executor.start()
    return executor
