"""A peak plan's prediction, term by term: what ``explain()`` prints and tests add up.

The peak model (``solver.peak``) prices a plan as the step's held bytes, nested
groups' buffers, the plan's residuals and the largest phase's fixed bytes. A
refined plan's peak is measured instead (``client.peak.refine``), and the
difference has to land somewhere for the terms to add up: it lands in the
working set of the phase that sets the peak, and a phase priced over that
measured peak is shown as holding at most it. One function derives the terms,
so no printout re-derives them (it once marked a phase larger than the
prediction, and printed a negative working set for a step without regions).
"""

from __future__ import annotations

from dataclasses import dataclass

from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import BudgetView, Phase, nesting_bytes
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import Solution

__all__ = ["WHOLE_STEP", "PeakBreakdown", "PhaseShare", "breakdown"]

# The one phase of a step whose graph prices none (priced as before phases, no region).
WHOLE_STEP = "the whole step"


@dataclass(frozen=True)
class PhaseShare:
    """What one phase of the step holds beyond the arguments, gradients and nested
    groups' buffers: ``planned + others + working - freed == total``, each at least 0."""

    name: str  # "backward of region 0", "outside the regions" or WHOLE_STEP
    region: int  # the region whose backward this is; -1 outside every region
    total: int
    planned: int  # the plan's residuals on the device, live in every phase
    others: int  # residuals no plan changes that are live here
    working: int  # its working set
    freed: int  # residuals XLA frees before this phase's peak (measured under the price)
    peak: bool  # the phase that sets the step's peak
    priced: int  # what the peak model prices it at

    @property
    def capped(self) -> bool:
        """Priced over the peak the plan measured: it holds at most ``total``."""
        return not self.peak and self.priced > self.total


@dataclass(frozen=True)
class PeakBreakdown:
    """A plan's predicted peak: ``held_bytes + nesting_bytes + peak.total``."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    nesting_bytes: int  # nested groups' inputs and parameter slices
    phases: tuple[PhaseShare, ...]

    @property
    def held_bytes(self) -> int:
        """Arguments + gradients - donated: held for the whole step."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def peak(self) -> PhaseShare:
        return next(p for p in self.phases if p.peak)

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.nesting_bytes + self.peak.total


def breakdown(graph: CostGraph, solution: Solution) -> PeakBreakdown:
    """The terms of ``solution.peak_bytes`` (a peak plan's) on ``graph``, a step's."""
    step = graph.step
    assert step is not None and solution.peak_bytes is not None
    groups = list(solution.groups or [1] * len(step.regions))
    view = BudgetView.of(graph, None, groups)
    # An offloaded residual is on the host at the peak.
    planned = view.predicted(solution.kept()) - view.held_bytes - solution.host_bytes
    nesting = nesting_bytes(step, groups)
    peak_total = solution.peak_bytes - step.held_bytes - nesting
    phases = list(view.phases) or [Phase(WHOLE_STEP, -1, 0)]
    peak = max(phases, key=lambda p: p.fixed_bytes)
    shares = []
    for phase in phases:
        priced = planned + phase.fixed_bytes
        total = peak_total if phase is peak else min(priced, peak_total)
        working = phase.working_bytes + total - priced  # the correction lands here
        shares.append(PhaseShare(phase.name, phase.region, total, planned,
                                 phase.fixed_residual_bytes, max(working, 0),
                                 max(-working, 0), phase is peak, priced))
    return PeakBreakdown(step.argument_bytes, step.output_bytes, step.alias_bytes, nesting,
                         tuple(shares))


def residual_parts(graph: CostGraph, region: int,
                   kept: list[bool]) -> tuple[int, int, set[int]]:
    """The residuals of the plan keeping ``kept``, by where a scan region keeps them:
    the bytes stacked over region ``region``'s layers, the bytes made in the region once
    (loop-invariant, hoisted), and the other residual values (arguments, values made
    outside the scan)."""
    stacked = hoisted = 0
    other: set[int] = set()
    value_region = graph.value_region or [-1] * graph.num_values
    node_region = graph.node_region or [-1] * graph.num_nodes
    for v in evaluate(graph, kept).residuals:
        producer = graph.producer[v]
        if value_region[v] == region:
            stacked += graph.value_bytes[v]
        elif producer is not None and node_region[producer] == region:
            hoisted += graph.value_bytes[v]
        else:
            other.add(v)
    return stacked, hoisted, other
