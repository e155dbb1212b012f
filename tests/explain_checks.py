"""What every peak plan's explanation must satisfy: its terms add up to the prediction."""

from __future__ import annotations

import re

from optiremat.client.explain import peak_breakdown
from optiremat.solver.breakdown import breakdown
from optiremat.solver.graph import CostGraph
from optiremat.solver.semantics import evaluate
from optiremat.solver.solution import Solution


def check_explained(graph: CostGraph, solution: Solution) -> None:
    """The arguments, gradients, nested groups' buffers and the phase marked as the
    peak add up to the predicted peak; that phase is the largest; each phase's parts
    add up to it; no figure is negative, in numbers or in words."""
    terms = breakdown(graph, solution)
    assert terms.peak_bytes == solution.peak_bytes
    assert graph.step is not None and terms.held_bytes == graph.step.held_bytes
    assert terms.peak.total == max(p.total for p in terms.phases)
    assert sum(p.peak for p in terms.phases) == 1
    for p in terms.phases:
        assert min(p.total, p.planned, p.others, p.working, p.freed) >= 0, p
        assert p.planned + p.others + p.working - p.freed == p.total, p
    text = "\n".join(peak_breakdown(graph, solution, evaluate(graph, solution.kept())))
    assert not re.search(r"(?<![\w.])-\d", text), text
    assert text.count("<- peak") == 1
