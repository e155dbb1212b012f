"""The peak planner: a plan whose compiled training step peaks within the budget.

The function, traced once, is walked as the step differentiates it with a remat
region in every differentiated ``lax.scan`` (``client.peak.step_graph``, which also
calibrates each phase's working set), solved at the budget, and refined against
the step compiled with the plan applied (``client.peak.refine``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import optiremat.client._jax_internals as jx
from optiremat.client.extract import Traced
from optiremat.client.peak.finding import why_no_regions
from optiremat.client.peak.measures import step_measure
from optiremat.client.peak.mixing import with_layers_apart
from optiremat.client.peak.placement import Placement, keeps_barriers, measured_with_barriers
from optiremat.client.peak.refine import refined_solve, smallest_budget
from optiremat.client.peak.regions import Region
from optiremat.client.peak.step_graph import traced_step_extraction
from optiremat.client.plan import PeakPlan, PlanError
from optiremat.client.schedule import (
    ScheduleWarning,
    barriers_kept,
    merged_infeasible_why,
    merged_schedule_note,
    schedule_advice,
)
from optiremat.solver.solution import InfeasibleBudgetError, Solution
from optiremat.solver.solve import Solver

if TYPE_CHECKING:
    from optiremat.client.planning import PlanRequest


def warn_if_unscheduled(regions: Sequence[Region], request: PlanRequest) -> None:
    """Warn where this process's compiles would merge checkpoints in straight-line code
    back into the forward pass and the plan is not measured as this process compiles (it
    is for a compile with the barriers kept, or it is not measured), so that its peak is
    not what ``jax.jit`` here gives."""
    if not merges_blocks(regions):
        return
    if request.schedule == "barriers_kept" or not measured(request):
        warnings.warn(ScheduleWarning(
            "The plan checkpoints blocks of straight-line code, and its peak is priced "
            "with their barriers kept. " + schedule_advice()), stacklevel=5)


def merges_blocks(regions: Sequence[Region]) -> bool:
    """Whether this process's default compile merges these regions' checkpointed blocks
    back into the forward pass."""
    return keeps_barriers(regions) and not barriers_kept()


def measured(request: PlanRequest) -> bool:
    """Whether the plan is refined against its step compiled (offload plans are not: on
    CPU, XLA's memory analysis counts host buffers as device ones)."""
    return request.refine and not request.offload


def plan_peak(fun: Callable, traced: Traced, args: Sequence, request: PlanRequest,
              solve_fn: Solver) -> PeakPlan:
    """The ``PeakPlan`` of ``request`` for ``fun``, traced at ``args`` as ``traced``."""
    if not request.tie:
        raise PlanError("peak plans are tied by policy key: pass tie=True, or plan "
                        "residuals with memory='residuals', tie=False")
    budget_bytes = request.budget_bytes(traced)
    # An offload plan may offload each layer's input too: it is named for the policy.
    extracted = traced_step_extraction(traced, args, request.step,
                                       name=getattr(fun, "__qualname__", ""),
                                       name_inputs=request.offload, scopes=request.scopes)
    graph, options, regions = extracted.graph, request.tied(), extracted.regions

    def solve_at(budget: int) -> Solution:
        return solve_fn(graph, budget, options)

    placement = Placement(regions, extracted.differentiated, request.step,
                          name_inputs=request.offload, scopes=extracted.scopes)
    warn_if_unscheduled(regions, request)
    # A plan for this process whose compile merges its blocks back is measured as this
    # process compiles, and says what it would measure with the barriers kept.
    for_merged = merges_blocks(regions) and request.schedule == "process" and measured(request)
    try:
        if measured(request):
            measure = step_measure(fun, args, extracted, placement,
                                   measured_with_barriers(regions, request.schedule))
            solution = refined_solve(graph, regions, budget_bytes, solve_at, measure)
            if request.layer_groups:
                solution = with_layers_apart(graph, regions, solution, solve_at, measure)
        else:
            solution = solve_at(budget_bytes)
    except InfeasibleBudgetError as err:
        if for_merged:
            kept = step_measure(fun, args, extracted, placement, keep_barriers=True)
            raise InfeasibleBudgetError(
                err.budget_bytes, err.min_budget_bytes,
                merged_infeasible_why(smallest_budget(graph, solve_at, kept))) from None
        if regions or err.why:
            raise
        why = why_no_regions(jx.ClosedJaxpr(traced.open_jaxpr, traced.consts),
                             extracted.differentiated)
        raise InfeasibleBudgetError(err.budget_bytes, err.min_budget_bytes,
                                    f"No plan can lower the peak: {why}") from None
    note = ""
    if for_merged and solution.peak_bytes is not None:
        kept = step_measure(fun, args, extracted, placement, keep_barriers=True)
        groups = solution.groups
        kept_peak = kept.peak_of(frozenset(solution.saved_keys),
                                 None if not groups or all(k == 1 for k in groups)
                                 else tuple(groups))
        note = merged_schedule_note(solution.peak_bytes, kept_peak)
    return PeakPlan(graph, solution, traced, options,
                    key_aliases=extracted.extraction.key_aliases, placement=placement,
                    schedule=request.schedule, schedule_note=note)
