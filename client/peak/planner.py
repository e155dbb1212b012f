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
from optiremat.client.peak.block_region import BlockRegion
from optiremat.client.peak.finding import why_no_regions
from optiremat.client.peak.measures import step_measure
from optiremat.client.peak.mixing import with_layers_apart
from optiremat.client.peak.placement import Placement
from optiremat.client.peak.refine import refined_solve
from optiremat.client.peak.regions import Region
from optiremat.client.peak.step_graph import traced_step_extraction
from optiremat.client.plan import PeakPlan, PlanError
from optiremat.client.schedule import ScheduleWarning, barriers_kept, schedule_advice
from optiremat.solver.solution import InfeasibleBudgetError, Solution
from optiremat.solver.solve import Solver

if TYPE_CHECKING:
    from optiremat.client.planning import PlanRequest


def warn_if_unscheduled(regions: Sequence[Region]) -> None:
    """Warn where this process's compiles would merge checkpoints in straight-line code
    back into the forward pass, so that the plan's peak is not what the user gets."""
    if any(isinstance(r, BlockRegion) for r in regions) and not barriers_kept():
        warnings.warn(ScheduleWarning(
            "The plan checkpoints blocks of straight-line code, and its peak is measured "
            "with their barriers kept. " + schedule_advice()), stacklevel=5)


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
    graph, options = extracted.graph, request.tied()

    def solve_at(budget: int) -> Solution:
        return solve_fn(graph, budget, options)

    placement = Placement(extracted.regions, extracted.differentiated, request.step,
                          name_inputs=request.offload, scopes=extracted.scopes)
    # Offload plans are not refined: on CPU, XLA's memory analysis counts host
    # buffers as device ones, so their peak cannot be measured here.
    warn_if_unscheduled(extracted.regions)
    try:
        if request.refine and not request.offload:
            measure = step_measure(fun, args, extracted, placement)
            solution = refined_solve(graph, extracted.regions, budget_bytes, solve_at, measure)
            if request.layer_groups:
                solution = with_layers_apart(graph, extracted.regions, solution, solve_at,
                                             measure)
        else:
            solution = solve_at(budget_bytes)
    except InfeasibleBudgetError as err:
        if extracted.regions or err.why:
            raise
        why = why_no_regions(jx.ClosedJaxpr(traced.open_jaxpr, traced.consts),
                             extracted.differentiated)
        raise InfeasibleBudgetError(err.budget_bytes, err.min_budget_bytes,
                                    f"No plan can lower the peak: {why}") from None
    return PeakPlan(graph, solution, traced, options,
                    key_aliases=extracted.extraction.key_aliases, placement=placement)
