"""What a run computes: the task, its request hash, and ``run_task``, the one solve path.

A task names its graph by content hash; the graph's JSON travels beside it (a pipe
to a pool process, a Redis key for an RQ worker). The embedded pool's processes
(``pool_worker``) and the cluster's RQ workers (``rq_worker``) both call
``run_task``. This module imports only pydantic and ``optiremat.solver`` (the
solver itself on first use): never FastAPI, never JAX.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from enum import StrEnum
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from optiremat.service.core.outcome import BudgetRange, Failed, Infeasible, Solved, TaskResult
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.solution import SolveOptions
from optiremat.solver.validation import OutOfRangeError
from optiremat.solver.wire import Progress

# Progress is forwarded at most this often unless the incumbent improved.
_PROGRESS_INTERVAL_S = 0.1


@cache
def solver_version() -> str:
    """Versions that can change an answer; part of every request hash."""
    parts = []
    for dist in ("optiremat", "ortools"):
        try:
            parts.append(f"{dist}-{version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist}-unknown")
    return "+".join(parts)


class _Task(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    graph_hash: str

    @property
    def key(self) -> str:
        """The request hash: job id, cache key and single-flight key.

        sha256 over the task's JSON (defaults included) and the solver version.
        """
        doc = {**self.model_dump(mode="json"), "solver_version": solver_version()}
        return hashlib.sha256(
            json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()


class SolveTask(_Task):
    """One graph, one budget: ``POST /v1/solve``, a job, a frontier point."""

    kind: Literal["solve"] = "solve"
    budget_bytes: int
    options: SolveOptions

    @property
    def time_limit_s(self) -> float:
        return self.options.time_limit_s


class BudgetRangeTask(_Task):
    """The smallest feasible and the largest useful budget: the ends of a frontier."""

    kind: Literal["budget_range"] = "budget_range"
    tie: bool
    # With offload the smallest device budget may be lower (left out when unset, so
    # a range asked without it keeps its key).
    offload: OffloadOptions | None = Field(default=None, exclude_if=lambda v: v is None)

    @property
    def time_limit_s(self) -> float:
        # min_feasible_budget runs CP-SAT under SolveOptions' default time limit
        return SolveOptions().time_limit_s


class Lane(StrEnum):
    """Where a run waits for a worker: workers take sync runs first, and some take
    nothing else (``fair_queue``; in cluster mode, RQ queues named per lane)."""

    SYNC = "sync"  # a client waits on it: POST /v1/solve, a frontier's points and range
    BACKGROUND = "background"  # a job


Task = Annotated[SolveTask | BudgetRangeTask, Field(discriminator="kind")]
TASKS: TypeAdapter[Task] = TypeAdapter(Task)


class CancelFlag(Protocol):
    """What the solver polls: a ``threading.Event`` or a ``multiprocessing`` one."""

    def is_set(self) -> bool: ...


def _solve(task: SolveTask, graph_json: str, cancel: CancelFlag,
           report: Callable[[Progress], None]) -> TaskResult:
    from optiremat.solver.graph import CostGraph
    from optiremat.solver.peak import resolve_memory
    from optiremat.solver.solution import InfeasibleBudgetError
    from optiremat.solver.solve import solve

    graph = CostGraph.model_validate_json(graph_json)
    last_sent = 0.0
    last_incumbent: int | None = None

    def progress(incumbent_flops: int | None, bound_flops: int | None, elapsed_s: float) -> None:
        nonlocal last_sent, last_incumbent
        now = time.monotonic()
        if incumbent_flops == last_incumbent and now - last_sent < _PROGRESS_INTERVAL_S:
            return
        last_sent, last_incumbent = now, incumbent_flops
        report(Progress(
            incumbent_flops=None if incumbent_flops is None else int(incumbent_flops),
            bound_flops=None if bound_flops is None else int(bound_flops),
            elapsed_s=float(elapsed_s),
        ))

    try:
        # The solver only calls is_set(): a multiprocessing Event does as well as a thread's.
        solution = solve(graph, task.budget_bytes, task.options,
                         progress=progress, cancel=cancel)  # type: ignore[arg-type]
    except InfeasibleBudgetError as exc:
        return Infeasible(budget_bytes=exc.budget_bytes, min_budget_bytes=exc.min_budget_bytes,
                          memory=resolve_memory(graph, task.options.memory))
    return Solved(solution_json=solution.model_dump_json())


def _budget_range(task: BudgetRangeTask, graph_json: str) -> TaskResult:
    from optiremat.solver.graph import CostGraph
    from optiremat.solver.solve import max_useful_budget, min_feasible_budget

    graph = CostGraph.model_validate_json(graph_json)
    return BudgetRange(min_feasible_budget=int(min_feasible_budget(graph, tie=task.tie,
                                                                   offload=task.offload)),
                       max_useful_budget=int(max_useful_budget(graph)))


def run_task(task: Task, graph_json: str, cancel: CancelFlag,
             report: Callable[[Progress], None]) -> TaskResult:
    """Run one task on its graph; never raises.

    ``report`` may be called from the solver's own threads.
    """
    try:
        if isinstance(task, SolveTask):
            return _solve(task, graph_json, cancel, report)
        return _budget_range(task, graph_json)
    except OutOfRangeError as exc:
        return Failed(message=str(exc), invalid=True)
    except Exception as exc:  # a solver bug must fail the task, not the worker
        return Failed(message=f"{type(exc).__name__}: {exc}")
