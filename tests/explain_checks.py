"""What every peak plan's explanation must satisfy: its terms add up to the prediction."""

from __future__ import annotations

import re

from optiremat.client.explain import peak_breakdown, phase_figures
from optiremat.solver.graph import CostGraph
from optiremat.solver.peak import nesting_bytes
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import Solution


def check_explained(graph: CostGraph, solution: Solution) -> None:
    """The arguments, gradients, nested groups' buffers and the phase marked as the
    peak add up to the predicted peak; that phase is the largest; each phase's parts
    add up to it; no figure is negative, in numbers or in words."""
    step = graph.step
    assert step is not None and solution.peak_bytes is not None
    figures = phase_figures(graph, solution)
    (peak,) = [f for f in figures if f.peak]
    assert peak.total == max(f.total for f in figures)
    groups = list(solution.groups or [1] * len(step.regions))
    assert step.held_bytes + nesting_bytes(step, groups) + peak.total == solution.peak_bytes
    for f in figures:
        assert min(f.total, f.planned, f.others, f.working, f.freed) >= 0, f
        assert f.planned + f.others + f.working - f.freed == f.total, f
    text = "\n".join(peak_breakdown(graph, solution, evaluate(graph, solution.kept())))
    assert not re.search(r"(?<![\w.])-\d", text), text
    assert text.count("<- peak") == 1
