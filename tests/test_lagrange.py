"""The minimum cut solves the Lagrangian problem exactly, so its bound is valid.

For every price ``lam`` of a byte in FLOPs, the cut's plan must minimise
``backward_flops + lam * residual_bytes`` over *all* untied plans (brute force
on random graphs with multi-output nodes, forced modes and loop carries), and
the walk's bound must never exceed the optimum at any budget.
"""

from __future__ import annotations

import importlib
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optiremat.solver import CostGraph, max_useful_budget, solve
from optiremat.solver.lagrange import CutModel, bound_and_plans
from optiremat.solver.semantics import baseline_backward_flops, evaluate
from optiremat.solver.synthetic import transformer_like
from tests.test_solver import graphs, optimum, plans

PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def backward_points(g: CostGraph) -> list[tuple[int, int]]:
    """(residual bytes, backward FLOPs) of every untied plan."""
    base = baseline_backward_flops(g)
    return [(nbytes, flops + base) for nbytes, flops in plans(g, tie=False)]


@PROPERTY
@given(g=graphs(), lam=st.fractions(min_value=0, max_value=20, max_denominator=7))
def test_cut_minimises_flops_plus_priced_bytes_over_every_plan(g: CostGraph,
                                                              lam: Fraction) -> None:
    point, lower = CutModel(g).minimize(lam)
    best = min(flops + lam * nbytes for nbytes, flops in backward_points(g))
    ev = evaluate(g, list(point.saves))
    assert (ev.backward_flops, ev.residual_bytes) == (point.backward_flops, point.residual_bytes)
    assert point.backward_flops + lam * point.residual_bytes == best
    assert lower <= best
    assert best - lower < Fraction(1, 10**6)  # rounding to integer capacities is negligible


@PROPERTY
@given(g=graphs(), data=st.data())
def test_bound_never_exceeds_the_optimum_and_its_plan_fits(g: CostGraph,
                                                           data: st.DataObject) -> None:
    points = backward_points(g)
    budget = data.draw(st.integers(0, max(nbytes for nbytes, _ in points)))
    found = bound_and_plans(g, budget)
    best = optimum(points, budget)
    if best is None:
        assert found.best is None
        return
    assert found.backward_flops <= best
    assert found.best is not None and found.best.residual_bytes <= budget
    assert found.best.backward_flops >= best


def test_cut_bound_is_tight_on_a_transformer_and_proves_untied_plans() -> None:
    g = transformer_like(6)
    budget = max_useful_budget(g) // 2
    found = bound_and_plans(g, budget)
    s = solve(g, budget, tie=False, relative_gap=0.001)
    base = baseline_backward_flops(g)
    assert s.status == "optimal"
    assert found.backward_flops - base <= s.lower_bound_flops <= s.recompute_flops


def test_without_time_for_a_search_the_answer_is_the_best_start_with_the_cut_bound(
    monkeypatch,
) -> None:
    search_module = importlib.import_module("optiremat.solver.search")
    g = transformer_like(6)
    budget = max_useful_budget(g) // 2
    searched = solve(g, budget, tie=False)
    monkeypatch.setattr(search_module, "MILP_VARIABLES_PER_SECOND", 0)
    quick = solve(g, budget, tie=False)
    cut = bound_and_plans(g, budget).backward_flops - baseline_backward_flops(g)
    tied = solve(g, budget)
    assert quick.residual_bytes <= budget
    # The cut's bound, rounded up to the next FLOPs count a plan can have.
    assert cut <= quick.lower_bound_flops <= searched.recompute_flops
    assert searched.recompute_flops <= quick.recompute_flops <= tied.recompute_flops
    proven = quick.recompute_flops == quick.lower_bound_flops
    assert quick.status == ("optimal" if proven else "feasible")


def test_mixing_the_hull_ends_gives_a_plan_close_to_the_bound_on_a_deep_stack() -> None:
    """Hull points of 24 identical layers lie far apart; switching the layers'
    difference piece by piece lands within the budget and near the bound."""
    g = transformer_like(24)
    budget = max_useful_budget(g) // 2
    found = bound_and_plans(g, budget)
    assert found.best is not None and found.best.residual_bytes <= budget
    base = baseline_backward_flops(g)
    best, bound = found.best.backward_flops - base, found.backward_flops - base
    assert bound <= best <= 1.03 * bound  # 2.3% here; the steps shrink as layers grow
    assert evaluate(g, list(found.best.saves)).residual_bytes == found.best.residual_bytes
