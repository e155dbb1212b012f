"""optiremat: optimal activation checkpointing for JAX.

``optiremat.optimize(fun, *args, budget=...)`` traces ``fun``, solves the
checkpointing MILP and returns a plan (a ``PeakPlan``, or a ``ResidualPlan``);
``RematClient`` does the same with a server's solver. The package has three
parts: ``optiremat.solver`` (the cost graph and the MILP; pydantic, and
OR-Tools from the first local solve on), ``optiremat.client`` (extraction
from JAX, plans, the remote client) and ``optiremat.service`` (the REST API).

The solver's names are imported here eagerly. The client's names are imported
on first use: the service and the CLI import this package too, and they must
not load JAX (0.9 s and 80 MB more per worker process, measured), nor need it
installed (the service image has no JAX). Type checkers see every name.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from optiremat.solver import (
    SCHEMA_VERSION,
    CostGraph,
    Decision,
    GraphError,
    InfeasibleBudgetError,
    OffloadOptions,
    OptirematError,
    Solution,
    SolveOptions,
    SolveStatus,
    max_useful_budget,
    solve,
)
from optiremat.solver import min_feasible_budget as _priced_min_feasible_budget

if TYPE_CHECKING:
    from optiremat.client import (
        BudgetError,
        CacheWarning,
        ConnectionFailed,
        ExtractionError,
        Frontier,
        KeyPolicy,
        MemoryBudget,
        NamesForm,
        PeakPlan,
        PlacementError,
        Plan,
        PlanError,
        PlanFile,
        PlanFileError,
        ProblemError,
        RematClient,
        RemoteError,
        ResidualPlan,
        ScheduleWarning,
        ShardingError,
        StepError,
        Verification,
        extract_graph,
        extract_step,
        load_plan,
        measured_peak,
        measured_save_price,
        memory_budget,
        optimize,
        plot_frontier,
        policy_key,
        sweep,
    )

__all__ = [
    "SCHEMA_VERSION",
    "BudgetError",
    "CacheWarning",
    "ConnectionFailed",
    "CostGraph",
    "Decision",
    "ExtractionError",
    "Frontier",
    "GraphError",
    "InfeasibleBudgetError",
    "KeyPolicy",
    "MemoryBudget",
    "NamesForm",
    "OffloadOptions",
    "OptirematError",
    "PeakPlan",
    "PlacementError",
    "ScheduleWarning",
    "Plan",
    "PlanError",
    "PlanFile",
    "PlanFileError",
    "ProblemError",
    "RematClient",
    "RemoteError",
    "ResidualPlan",
    "ShardingError",
    "Solution",
    "SolveOptions",
    "SolveStatus",
    "StepError",
    "Verification",
    "extract_graph",
    "extract_step",
    "load_plan",
    "max_useful_budget",
    "measured_peak",
    "measured_save_price",
    "memory_budget",
    "min_feasible_budget",
    "optimize",
    "plot_frontier",
    "policy_key",
    "solve",
    "sweep",
]


def min_feasible_budget(graph_or_fun: Any, *args: Any, **options: Any) -> int:
    """The smallest feasible budget. Of a ``CostGraph``: the least its model prices a
    plan at (``optiremat.solver.min_feasible_budget``, whose options ``args`` and
    ``options`` are). Of a function at ``args``: the smallest budget
    ``optimize(fun, *args, **options)`` plans, which its ``InfeasibleBudgetError``
    names too (measured: the plans' steps compiled; ``client.peak.refine``)."""
    if isinstance(graph_or_fun, CostGraph):
        return _priced_min_feasible_budget(graph_or_fun, *args, **options)
    from optiremat.client.planning import smallest_budget

    return smallest_budget(graph_or_fun, *args, **options)


# What __getattr__ imports from optiremat.client on first use.
_CLIENT_NAMES = frozenset(__all__) - frozenset(globals())


def __getattr__(name: str) -> Any:
    if name not in _CLIENT_NAMES:
        raise AttributeError(f"module 'optiremat' has no attribute {name!r}")
    try:
        client = import_module("optiremat.client")
    except ModuleNotFoundError as exc:
        if exc.name not in ("jax", "jaxlib"):
            raise
        raise ImportError(
            f"optiremat.{name} needs JAX, which is not installed here: "
            "pip install 'optiremat[client]'") from exc
    value = getattr(client, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT_NAMES)
