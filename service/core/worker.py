"""The worker process: runs solver calls for the pool, one at a time.

This module is the entry point of a spawned process, so it imports only solver/
(never FastAPI, never JAX). Results travel back as the small dataclasses below.
``run_task`` is the one solve path: the embedded pool's processes and the
cluster's RQ workers (``optiremat.service.core.rq_worker``) both call it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any, Protocol


@dataclass(frozen=True)
class Solved:
    solution_json: str  # Solution.model_dump_json(): served byte for byte


@dataclass(frozen=True)
class Infeasible:
    budget_bytes: int
    min_budget_bytes: int


@dataclass(frozen=True)
class BudgetRange:
    min_feasible_budget: int
    max_useful_budget: int


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Ready:
    """Sent once, when the worker has imported the solver and takes tasks."""


@dataclass(frozen=True)
class ProgressReport:
    incumbent_flops: int | None
    bound_flops: int | None
    elapsed_s: float


WorkerResult = Solved | Infeasible | BudgetRange | Failed


class CancelFlag(Protocol):
    """What the solver polls: a ``threading.Event`` or a ``multiprocessing`` one."""

    def is_set(self) -> bool: ...


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


def _solve(payload: dict[str, Any], cancel: CancelFlag,
           report: Callable[[ProgressReport], None]) -> WorkerResult:
    from optiremat.solver.graph import CostGraph
    from optiremat.solver.solution import InfeasibleBudgetError, SolveOptions
    from optiremat.solver.solve import solve

    graph = CostGraph.model_validate_json(payload["graph_json"])
    options = SolveOptions.model_validate(payload["options"])
    last: dict[str, Any] = {"t": 0.0, "incumbent": None}

    def progress(incumbent_flops: int | None, bound_flops: int | None, elapsed_s: float) -> None:
        now = time.monotonic()
        if incumbent_flops == last["incumbent"] and now - last["t"] < _PROGRESS_INTERVAL_S:
            return
        last.update(t=now, incumbent=incumbent_flops)
        report(ProgressReport(
            None if incumbent_flops is None else int(incumbent_flops),
            None if bound_flops is None else int(bound_flops),
            float(elapsed_s),
        ))

    try:
        # The solver only calls is_set(): a multiprocessing Event does as well as a thread's.
        solution = solve(graph, payload["budget_bytes"], options,
                         progress=progress, cancel=cancel)  # type: ignore[arg-type]
    except InfeasibleBudgetError as exc:
        return Infeasible(exc.budget_bytes, exc.min_budget_bytes)
    return Solved(solution.model_dump_json())


def _budget_range(payload: dict[str, Any]) -> WorkerResult:
    from optiremat.solver.graph import CostGraph
    from optiremat.solver.solve import max_useful_budget, min_feasible_budget

    graph = CostGraph.model_validate_json(payload["graph_json"])
    return BudgetRange(
        int(min_feasible_budget(graph, tie=payload["tie"])),
        int(max_useful_budget(graph)),
    )


def run_task(kind: str, payload: dict[str, Any], cancel: CancelFlag,
             report: Callable[[ProgressReport], None]) -> WorkerResult:
    """Run one task (``payload`` carries ``graph_json``); never raises.

    ``report`` may be called from the solver's own threads.
    """
    try:
        if kind == "solve":
            return _solve(payload, cancel, report)
        if kind == "budget_range":
            return _budget_range(payload)
        return Failed(f"unknown task kind {kind!r}")
    except Exception as exc:  # a solver bug must fail the task, not the worker
        return Failed(f"{type(exc).__name__}: {exc}")


def worker_main(conn: Connection, cancel: Event) -> None:
    """Serve ``(kind, payload)`` tasks from ``conn`` until it closes or sends ``None``."""
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import optiremat.solver.solve  # noqa: F401  (warm the import before the first task)

    send_lock = threading.Lock()

    def send(message: object) -> None:
        with send_lock:  # the solver may report progress from its own threads
            conn.send(message)

    send(Ready())
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        kind, payload = task
        send(run_task(kind, payload, cancel, send))
