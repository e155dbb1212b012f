"""The interface every MILP backend implements.

A backend is built once per formulation and then asked to minimise one of its
sums (the cost, recompute FLOPs or with offload FLOP-equivalents; the bytes a
budget caps; with offload, host bytes) under caps on the first two, in the
formulation's scaled units.
Several phases of one solve reuse the model and warm-start from the previous
phase's solution. Backends only search; turning their answer into an exact
plan is ``solver.search``'s job. Only CP-SAT takes a formulation's offload layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

CANCEL_POLL_S = 0.02  # how soon a cancel request reaches a running solver

# Called on each new incumbent with (objective, bound), both in scaled units.
IncumbentCallback = Callable[[float, float], None]


class Objective(StrEnum):
    COST = "cost"  # ``Formulation.cost``
    BYTES = "bytes"  # ``Formulation.budgeted_bytes``
    HOST = "host"  # the offload layer's host bytes (CP-SAT only)


class BackendStatus(StrEnum):
    OPTIMAL = "optimal"  # proven within the requested relative gap
    FEASIBLE = "feasible"  # stopped (time limit, cancel) with a solution
    INFEASIBLE = "infeasible"
    NO_SOLUTION = "no_solution"  # stopped before any solution was found


@dataclass(frozen=True)
class Goal:
    """Minimise ``objective`` with both sums at most their cap (None: uncapped)."""

    objective: Objective
    bytes_cap: int | None = None
    cost_cap: int | None = None


@dataclass(frozen=True)
class RawResult:
    outcome: BackendStatus
    decisions: tuple[bool, ...] | None  # one per formulation decision, None without a solution
    bound: float  # best proven bound on the scaled objective (0 when nothing is known)
    work: float = 0.0  # deterministic effort spent, in the backend's own unit
    offloads: tuple[bool, ...] = ()  # per decision, with the offload layer


class MilpBackend(Protocol):
    """``work_limit`` caps deterministic effort (CP-SAT: deterministic seconds,
    SCIP: branch-and-bound nodes), so where a bounded search stops does not
    depend on the machine; ``min_work`` is the least worth asking for.
    ``stop_at`` ends the search at the first solution whose objective is at most
    it (a bound proven elsewhere already makes that solution good enough); a
    backend without incumbent callbacks may ignore it."""

    name: str
    min_work: float

    def minimize(
        self,
        goal: Goal,
        *,
        time_limit_s: float,
        relative_gap: float,
        work_limit: float | None = None,
        on_incumbent: IncumbentCallback | None = None,
        cancel: threading.Event | None = None,
        stop_at: int | None = None,
    ) -> RawResult: ...

    def hint(self, values: list[int]) -> None:
        """Start the next search from this complete assignment (one value per variable)."""


@contextmanager
def stop_when_set(cancel: threading.Event | None, stop: Callable[[], None]) -> Iterator[None]:
    """Call ``stop`` from a watcher thread while ``cancel`` is set during the block.

    Only ``cancel.is_set()`` is used, so a ``multiprocessing.Event`` works too.
    ``stop`` is repeated on every poll: a request that lands just before the
    solver has started would otherwise be lost.
    """
    if cancel is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(CANCEL_POLL_S):
            if cancel.is_set():
                stop()

    watcher = threading.Thread(target=watch, name="optiremat-cancel", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
