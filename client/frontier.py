"""The budget sweep: recompute FLOPs against residual memory, and JAX's built-ins beside it.

``frontier`` solves locally with the budgets and Pareto marks the service's
``POST /v1/frontier`` uses, and returns the same ``Frontier`` model that
``RematClient.frontier`` parses from the server, so either feeds
``optiremat.client.plot.plot_frontier``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from optiremat.solver.frontier import mark_pareto, point_fields, solve_budgets, spaced_budgets
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import BudgetView
from optiremat.solver.semantics import baseline_backward_flops, evaluate
from optiremat.solver.solution import SolveOptions, SolveStatus
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, resolve_options
from optiremat.solver.step import Memory

__all__ = [
    "DEFAULT_POINTS",
    "Frontier",
    "FrontierPoint",
    "PolicyPoint",
    "builtin_points",
    "graph_builtin_points",
    "mark_pareto",
    "spaced_budgets",
    "sweep",
]

DEFAULT_POINTS = 12


class FrontierPoint(BaseModel):
    model_config = ConfigDict(extra="ignore")

    budget_bytes: int
    status: SolveStatus
    residual_bytes: int | None = None
    peak_bytes: int | None = None  # predicted peak of the training step (peak budgets)
    recompute_flops: int | None = None
    pareto: bool = False  # no other point has both fewer bytes and fewer FLOPs
    min_budget_bytes: int | None = None  # infeasible budgets: the smallest feasible one

    @property
    def memory_bytes(self) -> int | None:
        """What the budget counts: the predicted peak, or the residual bytes."""
        return self.peak_bytes if self.peak_bytes is not None else self.residual_bytes


class Frontier(BaseModel):
    model_config = ConfigDict(extra="ignore")

    graph_hash: str
    options: SolveOptions
    min_feasible_budget: int | None = None
    max_useful_budget: int | None = None
    points: list[FrontierPoint] = Field(default_factory=list)

    @property
    def plans(self) -> list[FrontierPoint]:
        """Points with a plan, by the bytes their budget counts."""
        return sorted((p for p in self.points if p.memory_bytes is not None),
                      key=lambda p: (p.memory_bytes, p.recompute_flops))


def sweep(graph: CostGraph, budgets: Sequence[int] | None = None,
             count: int | None = DEFAULT_POINTS, *, also: Sequence[int] = (),
             **options: object) -> Frontier:
    """Solve ``graph`` once per budget: explicit ``budgets``, or ``count`` spaced ones
    from the smallest feasible budget to the largest useful one (plus the feasible
    ones in ``also``). Each solve starts from the previous budget's plan
    (``optiremat.solver.frontier.solve_budgets``)."""
    resolved = resolve_options(None, dict(options))
    low = high = None
    if budgets is None:
        if count is None:
            raise ValueError("give budgets or count")
        low = min_feasible_budget(graph, resolved.tie, resolved.memory)
        high = max_useful_budget(graph, resolved.memory)
        budgets = spaced_budgets(low, high, count) + [b for b in also if low <= b <= high]
    results = solve_budgets(graph, budgets, resolved)
    points = [FrontierPoint(**point_fields(budget, result)) for budget, result in results.items()]
    mark_pareto(points)
    return Frontier(graph_hash=graph.content_hash, options=resolved, min_feasible_budget=low,
                    max_useful_budget=high, points=points)


# ---- JAX's built-in policies ---------------------------------------------------


@dataclass(frozen=True)
class PolicyPoint:
    """What one policy costs: residual bytes and recompute FLOPs over everything_saveable
    (and the predicted peak, on a step's graph)."""

    residual_bytes: int
    recompute_flops: int
    peak_bytes: int | None = None

    @property
    def memory_bytes(self) -> int:
        return self.peak_bytes if self.peak_bytes is not None else self.residual_bytes


def builtin_points(fun: Callable, *args: object) -> dict[str, PolicyPoint]:
    """JAX's built-in policies on ``fun`` at ``args``, measured from JAX itself
    (``saved_residuals`` and the backward pass's FLOPs)."""
    import jax

    from optiremat.client.measure import backward_flops, residual_bytes

    policies = jax.checkpoint_policies
    builtins = {
        "everything_saveable": policies.everything_saveable,
        "dots_saveable": policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
        "nothing_saveable": policies.nothing_saveable,
    }
    base = backward_flops(jax.checkpoint(fun, policy=policies.everything_saveable), *args)
    points = {}
    for name, policy in builtins.items():
        checkpointed = jax.checkpoint(fun, policy=policy)
        points[name] = PolicyPoint(residual_bytes(checkpointed, *args),
                                   backward_flops(checkpointed, *args) - base)
    return points


def graph_builtin_points(graph: CostGraph) -> dict[str, PolicyPoint]:
    """The built-ins a graph alone determines (no function to measure): save every
    equation the policy is offered, or none."""
    base = baseline_backward_flops(graph)
    view = BudgetView.of(graph, None)
    points = {}
    for name, saves in (("everything_saveable", [bool(key) for key in graph.node_key]),
                        ("nothing_saveable", [False] * graph.num_nodes)):
        ev = evaluate(graph, saves)
        peak = view.predicted(saves) if view.memory == Memory.PEAK else None
        points[name] = PolicyPoint(ev.residual_bytes, ev.backward_flops - base, peak)
    return points
