"""The budget sweep: recompute FLOPs against residual memory, and JAX's built-ins beside it.

``sweep`` solves locally with the budgets and Pareto marks the service's
``POST /v1/frontier`` uses, and returns the same ``Frontier`` model that
``RematClient.frontier`` parses from the server, so either feeds
``optiremat.client.plot.plot_frontier``. The two differ in how they solve: a sweep
warm-starts each budget from the last plan in one process; a frontier solves each
budget as its own cached request, so a point stopped by a time limit may differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optiremat.solver.baselines import BUILTIN_POLICIES, builtin_offered_saves
from optiremat.solver.frontier import (
    FrontierResult,
    frontier_of,
    mark_pareto,
    own_step_seconds,
    point_fields,
    solve_budgets,
    spaced_budgets,
)
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import BudgetView
from optiremat.solver.semantics import baseline_backward_flops, evaluate
from optiremat.solver.solution import InfeasibleBudgetError, Solution, SolveOptions
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, resolve_options, solve
from optiremat.solver.step import Memory
from optiremat.solver.wire import DEFAULT_FRONTIER_POINTS, Frontier, FrontierPoint

if TYPE_CHECKING:
    from optiremat.client.peak.measures import PeakMeasure
    from optiremat.client.peak.placement import Region

__all__ = [
    "DEFAULT_POINTS",
    "Frontier",
    "FrontierPoint",
    "PolicyPoint",
    "builtin_points",
    "graph_builtin_points",
    "lever_floors",
    "mark_pareto",
    "spaced_budgets",
    "sweep",
]

DEFAULT_POINTS = DEFAULT_FRONTIER_POINTS


def sweep(graph: CostGraph, budgets: Sequence[int] | None = None,
          count: int | None = DEFAULT_POINTS, *, also: Sequence[int] = (),
          regions: Sequence[Region] | None = None, measure: PeakMeasure | None = None,
          presets: Sequence[Sequence[bool]] = (), layer_groups: bool = True,
          **options: object) -> Frontier:
    """Solve ``graph`` once per budget: explicit ``budgets``, or ``count`` spaced ones
    from the smallest feasible budget to the largest useful one (plus the feasible
    ones in ``also``). Each solve starts from the previous budget's plan
    (``optiremat.solver.frontier.solve_budgets``). With ``offload=OffloadOptions(...)``
    on a step's graph each point is the best of recomputation per layer, nested
    groups and offload, and the frontier is peak bytes against estimated seconds.

    With a step's ``regions`` (``step_extraction(...).regions``, when the function is
    at hand) each plan without offload is refined against its own working set, as
    ``optimize`` refines it (``client.peak.refine``): one compile of one layer per policy,
    and peaks as XLA measures them rather than as the calibrated working set prices
    them (off by up to a fifth on the scan corpus). With a ``measure`` of the whole step
    (``client.peak.measures.step_measure``, as ``plot_function`` builds it) each plan is
    refined against the step compiled, and where the refined plan leaves room its scan's
    layers (or repeated blocks) are planned apart as ``optimize`` plans them
    (``client.peak.apart``), so that the frontier moves by a layer's difference rather
    than a stack's (not with ``layer_groups=False``). ``presets`` (per node, whether each
    saves it) are measured candidates of every refined plan: a names-only graph's
    framework presets, as ``optimize(..., saveable=)`` measures them."""
    resolved = resolve_options(None, dict(options))
    low = high = None
    if budgets is None:
        if count is None:
            raise ValueError("give budgets or count")
        low = min_feasible_budget(graph, resolved.tie, resolved.memory, resolved.nest,
                                  resolved.offload)
        high = max_useful_budget(graph, resolved.memory)
        budgets = spaced_budgets(low, high, count) + [b for b in also if low <= b <= high]
    if regions is not None and resolved.offload is None and graph.step is not None:
        results = _refined(graph, regions, budgets, resolved, measure, presets, layer_groups)
    else:
        results = solve_budgets(graph, budgets, resolved)
    points = [FrontierPoint(**point_fields(budget, result)) for budget, result in results.items()]
    return frontier_of(graph.content_hash, own_step_seconds(graph, resolved), resolved,
                       points, low, high)


def _refined(graph: CostGraph, regions: Sequence[Region], budgets: Sequence[int],
             options: SolveOptions, measure: PeakMeasure | None,
             presets: Sequence[Sequence[bool]], layer_groups: bool) -> dict[int, FrontierResult]:
    """Each budget's plan refined against its own working set (measurements are shared
    between budgets), its layers planned apart where ``measure`` compiles the step;
    a budget no refined plan fits is infeasible, naming the smallest measured peak."""
    from optiremat.client.peak.apart import refined_and_mixed

    def solve_at(b: int) -> Solution:
        return solve(graph, b, options)

    def solve_unnested(b: int) -> Solution:  # a mix's plans (``client.peak.mixing``)
        return solve(graph, b, options, nest=False)

    results: dict[int, FrontierResult] = {}
    for budget in sorted(set(budgets)):
        try:
            results[budget] = refined_and_mixed(graph, regions, budget, solve_at,
                                                solve_unnested, measure, presets, layer_groups)
        except InfeasibleBudgetError as err:
            results[budget] = err
    return results


def lever_floors(graph: CostGraph, **options: object) -> list[int]:
    """With offload options on a step's graph, the smallest budget of each lever
    without offload (nested groups; recomputation per layer): where each starts to
    fit, so that a sweep over the three levers (``also=``) shows every lever."""
    resolved = resolve_options(None, dict(options))
    if resolved.offload is None or graph.step is None:
        return []
    return sorted({min_feasible_budget(graph, resolved.tie, resolved.memory, nest)
                   for nest in (True, False)})


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
    builtins = {name: getattr(policies, name) for name in BUILTIN_POLICIES}
    base = backward_flops(jax.checkpoint(fun, policy=policies.everything_saveable), *args)
    points = {}
    for name, policy in builtins.items():
        checkpointed = jax.checkpoint(fun, policy=policy)
        points[name] = PolicyPoint(residual_bytes(checkpointed, *args),
                                   backward_flops(checkpointed, *args) - base)
    return points


def graph_builtin_points(graph: CostGraph, regions: Sequence[Region] | None = None,
                         policies: Mapping[str, Sequence[bool]] | None = None,
                         ) -> dict[str, PolicyPoint]:
    """JAX's built-in policies as the graph prices them: the equations each saves of
    those it is offered; on a step's graph, applied in every region (a checkpoint per
    layer), with their predicted peaks, each with its own working set measured where
    the step's ``regions`` are given (``client.peak.measures.working_set_delta``).
    ``policies`` prices others in their place (a framework's presets, per node whether
    each saves it)."""
    base = baseline_backward_flops(graph)
    view = BudgetView.of(graph, None)
    points = {}
    chosen = builtin_offered_saves(graph) if policies is None else policies
    for name, saves in chosen.items():
        offered = list(saves)
        ev = evaluate(graph, offered)
        peak = view.predicted(offered) if view.memory == Memory.PEAK else None
        if peak is not None and regions is not None:
            from optiremat.client.peak.measures import working_set_delta

            keys = frozenset(k for k, s in zip(graph.node_key, offered, strict=True) if s)
            peak += working_set_delta(graph, regions, offered, keys)
        points[name] = PolicyPoint(ev.residual_bytes, ev.backward_flops - base, peak)
    return points
