"""The solver at scale: untied starts from tied, sweeps reuse neighbours, answers repeat."""

from __future__ import annotations

import threading

import pytest

from optiremat.solver import (
    InfeasibleBudgetError,
    Solution,
    SolveOptions,
    max_useful_budget,
    min_feasible_budget,
    solve,
)
from optiremat.solver.frontier import solve_budgets, spaced_budgets
from optiremat.solver.solution import SolveStatus
from optiremat.solver.solve import solve_from
from optiremat.solver.synthetic import transformer_like


@pytest.fixture(scope="module")
def stack():
    return transformer_like(8, seq=128, d_model=256)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_untied_is_never_worse_than_tied_even_when_cut_short(stack, fraction: float) -> None:
    budget = int(max_useful_budget(stack) * fraction)
    tied = solve(stack, budget, tie=True)
    assert tied.status == SolveStatus.OPTIMAL
    # Cancelled at the untied search's first incumbent: the tied start is all it has.
    cancel = threading.Event()
    short = solve(stack, budget, tie=False, cancel=cancel,
                  progress=lambda *_: cancel.set())
    full = solve(stack, budget, tie=False)
    assert short.recompute_flops <= tied.recompute_flops
    assert short.residual_bytes <= budget
    assert full.recompute_flops <= tied.recompute_flops
    assert full.status == SolveStatus.OPTIMAL


def test_a_start_plan_is_a_ceiling_and_keeps_the_optimum(stack) -> None:
    budget = int(max_useful_budget(stack) * 0.4)
    cold = solve(stack, budget)
    save_all = [True] * stack.num_nodes  # over budget: ignored as a start
    assert solve_from(stack, budget, cold.options, save_all).recompute_flops == \
        cold.recompute_flops
    start = cold.saved()
    warm = solve_from(stack, budget, cold.options, start)
    assert warm.status == SolveStatus.OPTIMAL
    assert warm.recompute_flops == cold.recompute_flops


def test_a_warm_sweep_gives_each_budget_its_cold_optimum(stack) -> None:
    low, high = min_feasible_budget(stack), max_useful_budget(stack)
    budgets = spaced_budgets(low, high, 5) + [low - 1]
    options = SolveOptions()
    results = solve_budgets(stack, budgets, options)
    assert list(results) == sorted(budgets)
    assert isinstance(results[low - 1], InfeasibleBudgetError)
    for budget in budgets[:-1]:
        warm, cold = results[budget], solve(stack, budget, options)
        assert isinstance(warm, Solution)
        assert warm.status == SolveStatus.OPTIMAL
        assert (warm.recompute_flops, warm.residual_bytes) == \
            (cold.recompute_flops, cold.residual_bytes)
