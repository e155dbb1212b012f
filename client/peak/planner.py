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
from optiremat.client.frameworks import preset_saves
from optiremat.client.peak.apart import refined_and_mixed
from optiremat.client.peak.block_mixing import block_split
from optiremat.client.peak.finding import why_no_regions
from optiremat.client.peak.measures import StepMeasure, step_measure
from optiremat.client.peak.offload_fit import fitted_offload
from optiremat.client.peak.placement import Placement, keeps_barriers, measured_with_barriers
from optiremat.client.peak.priced import priced_budget, priced_note
from optiremat.client.peak.refine import smallest_budget
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
from optiremat.client.step import host_buffers_apart, lowered_peak
from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import Decision, InfeasibleBudgetError, Solution, SolveStatus
from optiremat.solver.solve import Solver, max_useful_budget
from optiremat.solver.step import RegionFound

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
    """Whether the plan is refined against its step compiled (offload plans are fitted
    apart, ``offload_measured``)."""
    return request.refine and not request.offload


def offload_measured(request: PlanRequest) -> bool:
    """Whether the offload plan is fitted to its step's measured device peak
    (``client.peak.offload_fit``): not on CPU, whose memory analysis counts host buffers
    as device ones."""
    return request.refine and bool(request.offload) and host_buffers_apart()


def plan_peak(fun: Callable, traced: Traced, args: Sequence, request: PlanRequest,
              solve_fn: Solver) -> PeakPlan:
    """The ``PeakPlan`` of ``request`` for ``fun``, traced at ``args`` as ``traced``."""
    if not request.tie:
        raise PlanError("peak plans are tied by policy key: pass tie=True, or plan "
                        "residuals with memory='residuals', tie=False")
    budget_bytes = asked = request.budget_bytes(traced)
    # An offload plan may offload each layer's input too: it is named for the policy.
    extracted = traced_step_extraction(traced, args, request.step,
                                       name=getattr(fun, "__qualname__", ""),
                                       name_inputs=request.offload, scopes=request.scopes,
                                       names=request.saveable.names)
    graph, options, regions = extracted.graph, request.tied(), extracted.regions

    def _plan(solution: Solution, note: str) -> PeakPlan:
        # A priced plan answers the budget asked, and says where it was planned.
        price_note = ""
        if request.save_price is not None:
            solution = solution.model_copy(update={"budget_bytes": asked})
            price_note = priced_note(request.save_price, asked, budget_bytes, solution)
        return PeakPlan(graph, solution, traced, options,
                        key_aliases=extracted.extraction.key_aliases,
                        checkpoint_names=extracted.extraction.names_by_key, placement=placement,
                        schedule=request.schedule, schedule_note=note, price_note=price_note)

    def solve_at(budget: int) -> Solution:
        return solve_fn(graph, budget, options)

    def solve_unnested(budget: int) -> Solution:
        # A mix's plans are one checkpoint per layer: their solves choose no nesting.
        return solve_fn(graph, budget, options.model_copy(update={"nest": False}))

    # A names-only plan is never worse than its framework's presets (or the built-ins).
    presets = list(preset_saves(graph, extracted.extraction.key_aliases,
                                extracted.extraction.names_by_key, request.saveable).values())
    placement = Placement(regions, extracted.differentiated, request.step,
                          name_inputs=request.offload, scopes=extracted.scopes)
    warn_if_unscheduled(regions, request)

    def plan_measure(barriers_kept: bool = False) -> StepMeasure:
        """A plan's step compiled as the request's schedule measures it, or with its
        blocks' barriers kept (what a plan for a process that merges them would reach)."""
        return step_measure(fun, args, extracted, placement, barriers_kept
                            or measured_with_barriers(regions, request.schedule))

    # A plan for this process whose compile merges its blocks back is measured as this
    # process compiles, and says what it would measure with the barriers kept.
    for_merged = merges_blocks(regions) and request.schedule == "process" and measured(request)
    try:
        if request.save_price is not None:
            budget_bytes = priced_budget(budget_bytes, solve_at, request.save_price)
        if measured(request):
            measure = plan_measure()

            def refined(at: int) -> Solution:
                return refined_and_mixed(graph, regions, at, solve_at, solve_unnested,
                                         measure, presets, request.layer_groups)

            try:
                solution = refined(budget_bytes)
            except InfeasibleBudgetError:
                if budget_bytes == asked:
                    raise
                # No plan measured within the cheapest's budget: the budget's own plan.
                budget_bytes = asked
                solution = refined(budget_bytes)
        elif offload_measured(request):
            measure = plan_measure()
            solution = fitted_offload(budget_bytes, solve_at, lambda plan: measure.measured(
                frozenset(plan.saved_keys), plan.groups, frozenset(plan.offloaded_keys)))
        else:
            solution = solve_at(budget_bytes)
    except InfeasibleBudgetError as err:
        written = as_written_peak(fun, args, placement) if measured(request) else None
        if written is not None and written <= budget_bytes:
            # Any solve gives the record its solver and options: saving everything fits.
            like = solve_at(max_useful_budget(graph))
            return _plan(no_checkpoint(graph, like, budget_bytes, written), "")
        if written is not None:  # it is a plan too: the smallest budget is at most its peak
            err = InfeasibleBudgetError(err.budget_bytes, min(err.min_budget_bytes, written),
                                        err.why)
        if for_merged:
            kept = plan_measure(barriers_kept=True)
            raise InfeasibleBudgetError(
                err.budget_bytes, err.min_budget_bytes,
                merged_infeasible_why(smallest_budget(graph, solve_at, kept, presets))) from None
        if regions or err.why:
            raise
        why = why_no_regions(jx.ClosedJaxpr(traced.open_jaxpr, traced.consts),
                             extracted.differentiated)
        raise InfeasibleBudgetError(err.budget_bytes, err.min_budget_bytes,
                                    f"No plan can lower the peak: {why}") from None
    # The plan with its blocks' barriers kept, for the note, compiles while the step as
    # written does (both are the last compiles).
    with_barriers = (plan_measure(barriers_kept=True)
                     if for_merged and solution.peak_bytes is not None else None)
    if with_barriers is not None and not solution.layer_groups:
        with_barriers.ahead(frozenset(solution.saved_keys), solution.groups)
    if measured(request):
        # Taken where it fits and recomputes less, or as little and peaks no higher: blocks
        # saving everything, their barriers kept, measured 97.03 MiB on the corpus U-Net
        # against 65.22 for its step as written.
        written = as_written_peak(fun, args, placement)
        if written is not None and written <= budget_bytes and (
                solution.recompute_flops > 0 or solution.peak_bytes is None
                or written <= solution.peak_bytes):
            return _plan(no_checkpoint(graph, solution, budget_bytes, written), "")
    note = ""
    if with_barriers is not None and solution.peak_bytes is not None:
        # A step with blocks mixes them, never a scan's layers (``client.peak.apart``).
        note = merged_schedule_note(solution.peak_bytes, (
            with_barriers.measured_blocks(block_split(solution)) if solution.layer_groups
            else with_barriers.measured(frozenset(solution.saved_keys), solution.groups)))
    return _plan(solution, note)


def as_written_peak(fun: Callable, args: Sequence, placement: Placement) -> int | None:
    """The measured peak of ``fun``'s step with no checkpoint added, where that is a plan
    the solver's graph does not offer: a step with blocks of straight-line code, none of
    them the user's own checkpoint (whose step as written recomputes). A plan for a scan
    saving everything is already the step's own peak; blocks saving everything are not
    (each block's checkpoint keeps its outputs apart: on jax 0.10 CPU, an unrolled Llama
    planned at its no-remat peak recomputed 3e6 FLOPs). None where it is not a plan."""
    regions = placement.regions
    if not keeps_barriers(regions) or any(r.found == RegionFound.CHECKPOINT for r in regions):
        return None
    return lowered_peak(placement.step.function(fun).lower(*args))


def no_checkpoint(graph: CostGraph, like: Solution, budget: int, peak: int) -> Solution:
    """The plan that adds no checkpoint (``Solution.no_checkpoint``), whose step measured
    ``peak``: every node saved, nothing recomputed; solver and options those of ``like``."""
    saves = [True] * graph.num_nodes
    return like.model_copy(update={
        "budget_bytes": budget, "status": SolveStatus.FEASIBLE,
        "residual_bytes": evaluate(graph, saves).residual_bytes, "recompute_flops": 0,
        "lower_bound_flops": 0, "gap": 0.0,
        "saved_keys": sorted({k for k in graph.node_key if k}), "offloaded_keys": [],
        "node_decisions": [Decision.SAVE] * graph.num_nodes, "baselines": None,
        "offload": None, "peak_bytes": peak, "working_bytes": None, "groups": None,
        "collective_bytes": None, "layer_groups": None, "no_checkpoint": True})
