"""Saves priced beside recompute: ``optimize(..., save_price=)`` (``client.peak.priced``)."""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import numpy as np
import pytest

import optiremat
from optiremat.client.peak.priced import GRID, priced_budget, priced_cost
from optiremat.client.plan import PlanError
from optiremat.client.planning import PlanRequest
from optiremat.solver.solution import InfeasibleBudgetError, SolveOptions
from tests.peak_models import small_llama

MiB = 2**20


@pytest.fixture(scope="module")
def stack():
    loss, args = small_llama()
    graph = optiremat.extract_step(loss, *args)
    options = SolveOptions(tie=True)

    def solve_at(budget):
        return optiremat.solve(graph, budget, options)

    try:
        solve_at(0)
    except InfeasibleBudgetError as err:
        low = err.min_budget_bytes
    top = solve_at(optiremat.max_useful_budget(graph)).peak_bytes
    return loss, args, solve_at, low, top


@pytest.mark.parametrize("price", [-1, float("nan"), math.inf, "60", True])
def test_a_bad_price_is_refused_naming_it(price):
    loss, args = small_llama()
    with pytest.raises(PlanError, match="save_price="):
        optiremat.optimize(loss, *args, budget="20MiB", save_price=price)


def test_a_price_needs_a_peak_budget_and_no_offload():
    loss, args = small_llama()
    with pytest.raises(PlanError, match="memory='peak'"):
        optiremat.optimize(loss, *args, budget="20MiB", memory="residuals", save_price=60)
    with pytest.raises(PlanError, match="offload="):
        optiremat.optimize(loss, *args, budget="20MiB", save_price=60,
                           offload=optiremat.OffloadOptions())


def test_priced_free_saves_plan_at_the_budget(stack):
    _, _, solve_at, low, top = stack
    budget = (low + top) // 2
    assert priced_budget(budget, solve_at, Fraction(0)) == budget


@pytest.mark.parametrize("price", [Fraction(4), Fraction(60), Fraction(10**6)])
def test_the_priced_budget_is_the_cheapest_plan_within_a_grid_step(stack, price):
    """Against the solver's plans at 60 budgets spread over the range, the chosen plan
    costs no more, up to the price of one grid step's bytes (``GRID``)."""
    _, _, solve_at, low, top = stack
    budget = low + (top - low) * 3 // 4
    chosen = solve_at(priced_budget(budget, solve_at, price))
    assert chosen.peak_bytes <= budget
    swept = [solve_at(low + (budget - low) * i // 59) for i in range(60)]
    least = min(priced_cost(plan, price) for plan in swept)
    assert priced_cost(chosen, price) <= least + price * (budget - low) // GRID
    # Never dearer than the plan by FLOPs alone at the budget.
    assert priced_cost(chosen, price) <= priced_cost(solve_at(budget), price)
    if price == 10**6:  # bytes dominate: the plan saving least
        assert chosen.residual_bytes == min(plan.residual_bytes for plan in swept)


def test_a_priced_plan_peaks_lower_runs_the_same_gradients_and_says_why(stack):
    loss, args, solve_at, low, top = stack
    budget = low + (top - low) * 3 // 4
    by_flops = optiremat.optimize(loss, *args, budget=budget)
    plan = optiremat.optimize(loss, *args, budget=budget, save_price=200)
    assert plan.budget_bytes == budget
    assert plan.peak_bytes < by_flops.peak_bytes
    assert plan.recompute_flops > by_flops.recompute_flops
    assert priced_cost(plan.solution, Fraction(200)) < priced_cost(by_flops.solution,
                                                                   Fraction(200))
    step = jax.jit(jax.grad(plan.apply(loss))).lower(*args).compile()
    assert optiremat.measured_peak(step) == plan.peak_bytes <= budget
    for a, b in zip(jax.tree.leaves(step(*args)),
                    jax.tree.leaves(jax.jit(jax.grad(loss))(*args)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "Saves priced at 200 FLOPs a byte" in plan.explain()
    assert "of the" in plan.explain()


def test_the_measured_price_is_a_positive_number_of_flops():
    price = optiremat.measured_save_price(rounds=1)
    assert math.isfinite(price) and price > 0
    assert PlanRequest.of(1, True, {"save_price": price}).save_price == Fraction(price)


def test_where_no_plan_measures_within_the_cheapests_budget_the_budgets_own_is_planned(
        stack, monkeypatch):
    """A stand-in search names a budget under every plan: refinement there finds none,
    and the plan is the one by FLOPs at the budget asked, saying so."""
    from optiremat.client.peak import planner

    loss, args, _, low, top = stack
    budget = (low + top) // 2
    monkeypatch.setattr(planner, "priced_budget", lambda b, solve_at, price: low // 2)
    plan = optiremat.optimize(loss, *args, budget=budget, save_price=60)
    by_flops = optiremat.optimize(loss, *args, budget=budget)
    assert plan.budget_bytes == budget
    assert plan.solution.fingerprint() == by_flops.solution.fingerprint()
    assert "was planned at the budget" in plan.explain()
