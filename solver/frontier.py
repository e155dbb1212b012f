"""The budget sweep: one place for the budgets, the warm-started solves and Pareto marks.

``optiremat.client.frontier.sweep`` (local) and the service's ``POST /v1/frontier`` both
space budgets with ``spaced_budgets``, build points with ``point_fields`` and
the answer with ``frontier_of``. With offload options a point's plan is the best
of the three levers at its budget (``solver.nesting``), priced in estimated
seconds. ``solve_budgets`` is the sweep itself: budgets
in increasing order on one ``optiremat.solver.solve.BudgetSeries`` (one formulation and backend
model for all of them), each solve started from the previous budget's plan. That
plan fits every larger budget, so it is a hint and a FLOPs ceiling (an upper
bound) for its neighbour: a search that would otherwise start from nothing
starts from a plan that is usually optimal or nearly so. With offload each
budget is solved as its own request (``BudgetSeries`` says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from optiremat.solver.graph import CostGraph
from optiremat.solver.offload import step_seconds
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions, SolveStatus
from optiremat.solver.solve import BudgetSeries
from optiremat.solver.wire import Frontier, FrontierPoint


class ParetoPoint(Protocol):
    status: SolveStatus
    residual_bytes: int | None
    peak_bytes: int | None
    recompute_flops: int | None
    estimated_seconds: float | None
    pareto: bool


def spaced_budgets(low: int, high: int, count: int) -> list[int]:
    """``count`` budgets evenly spaced from ``low`` to ``high`` (both included)."""
    if count < 2:
        raise ValueError(f"a sweep needs at least 2 points, got {count}")
    return sorted({low + (high - low) * i // (count - 1) for i in range(count)})


FrontierResult = Solution | InfeasibleBudgetError


def solve_budgets(
    graph: CostGraph,
    budgets: Sequence[int],
    options: SolveOptions,
    *,
    cancel: threading.Event | None = None,
    on_point: Callable[[int, FrontierResult], None] | None = None,
) -> dict[int, FrontierResult]:
    """One solve per distinct budget, smallest first, each warm-started from the last plan."""
    results: dict[int, FrontierResult] = {}
    start: list[bool] | None = None
    sweep = BudgetSeries(graph, options, cancel)
    for budget in sorted(set(budgets)):
        result: FrontierResult
        try:
            result = sweep.solve(budget, start)
        except InfeasibleBudgetError as err:
            result = err
        else:
            if result.planned:
                start = result.kept()
        results[budget] = result
        if on_point is not None:
            on_point(budget, result)
    return results


def point_fields(budget: int, result: FrontierResult) -> dict[str, Any]:
    """A frontier point's fields: an infeasible budget names the smallest feasible one;
    a timed-out solve has no plan to report."""
    if isinstance(result, InfeasibleBudgetError):
        return dict(budget_bytes=budget, status=SolveStatus.INFEASIBLE,
                    min_budget_bytes=result.min_budget_bytes)
    planned = result.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    fields = dict(budget_bytes=budget, status=result.status,
                  residual_bytes=result.residual_bytes if planned else None,
                  recompute_flops=result.recompute_flops if planned else None)
    if planned and result.peak_bytes is not None:
        fields["peak_bytes"] = result.peak_bytes
    if planned and result.offload is not None:
        fields["estimated_seconds"] = result.offload.estimated_seconds
        fields["host_bytes"] = result.offload.host_bytes
    if planned and result.groups is not None:
        fields["groups"] = result.groups
    if planned and result.layer_groups:
        fields["layer_groups"] = [group.layers for group in result.layer_groups]
    return fields


def own_step_seconds(graph: CostGraph, options: SolveOptions) -> float | None:
    """With offload options, the step's own estimated seconds (no remat, nothing
    moved), which a frontier shows beside its points; else None."""
    return None if options.offload is None else step_seconds(graph, options.offload)


def frontier_of(graph_hash: str, step: float | None, options: SolveOptions,
                points: list[FrontierPoint], low: int | None = None,
                high: int | None = None) -> Frontier:
    """The sweep's answer: ``points`` Pareto-marked, beside the graph's
    ``own_step_seconds``. It takes the graph's hash, not the graph: the service holds
    a graph as its text while it is solved (``service.core.graph_text``)."""
    mark_pareto(points)
    return Frontier(graph_hash=graph_hash, options=options, min_feasible_budget=low,
                    max_useful_budget=high, points=points, step_seconds=step)


def mark_pareto(points: Sequence[ParetoPoint]) -> None:
    """Set ``pareto`` on the plans no other plan beats in both bytes (the peak of
    peak plans, else residuals) and cost (estimated seconds where the points have
    them, else FLOPs; equal plans are all marked)."""
    plans = [(p, (p.peak_bytes if p.peak_bytes is not None else p.residual_bytes,
                  p.estimated_seconds if p.estimated_seconds is not None
                  else p.recompute_flops)) for p in points
             if p.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
             and p.residual_bytes is not None and p.recompute_flops is not None]
    for p, cost in plans:
        p.pareto = not any(other[0] <= cost[0] and other[1] <= cost[1] and other != cost
                           for _, other in plans)
