"""The offload time model in scan layouts: a layer's transfers overlap compute.

Per scan region and pass the plan adds max(compute, transfer) less the compute
(``optiremat.solver.offload.PlanTime``); the MILP poses the maxima with integer
variables. Checked here against every plan of a small step, enumerated.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.step import Step
from optiremat.solver.graph import CostGraph, NodeMode
from optiremat.solver.offload import OffloadOptions, PlanTime, evaluate_offload
from optiremat.solver.peak import BudgetView
from optiremat.solver.solution import Solution
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from tests.peak_models import residual_stack

CHOICES = ("recompute", "save", "offload")


@pytest.fixture(scope="module")
def step_graph() -> CostGraph:
    fun, args = residual_stack(layers=4, d=64, batch=128)
    return step_extraction(fun, args, Step.of(0)).graph


def _every_plan(view: BudgetView, options: OffloadOptions, budget: int) -> Fraction | None:
    """The least added time of any tied plan within ``budget`` and the host budget."""
    graph = view.graph
    keys = sorted({k for k, m in zip(graph.node_key, graph.node_mode, strict=True)
                   if k and m == NodeMode.FREE})
    forced = [m == NodeMode.SAVE for m in graph.node_mode]
    time = PlanTime(graph, options)
    best: Fraction | None = None
    for choice in itertools.product(CHOICES, repeat=len(keys)):
        by_key = dict(zip(keys, choice, strict=True))
        decided = [by_key.get(k) if m == NodeMode.FREE else None
                   for k, m in zip(graph.node_key, graph.node_mode, strict=True)]
        saves = [f if d is None else d != "recompute" for f, d in zip(forced, decided,
                                                                      strict=True)]
        plan = evaluate_offload(graph, saves, [d == "offload" for d in decided])
        if view.budget(plan.device_bytes) > budget or plan.host_bytes > options.host_budget_bytes:
            continue
        cost = time.cost(plan)
        best = cost if best is None else min(best, cost)
    return best


def _cost(view: BudgetView, options: OffloadOptions, sol: Solution) -> Fraction:
    plan = evaluate_offload(view.graph, sol.kept(), sol.offloaded())
    return PlanTime(view.graph, options).cost(plan)


# From transfers that outrun both passes' compute to ones that hide behind it; at
# 5e12 only the backward pass hides the offloaded bytes of the budgets below.
@pytest.mark.parametrize("bandwidth", [10**11, 10**12, 5 * 10**12, 10**13, 10**15])
def test_the_solve_finds_the_least_added_time_of_every_plan(step_graph, bandwidth):
    options = OffloadOptions(host_bandwidth=bandwidth, host_budget_bytes=2**20)
    view = BudgetView.of(step_graph, None)
    low = min_feasible_budget(step_graph, nest=False)
    high = max_useful_budget(step_graph)
    for budget in (low - (high - low) // 4, low - (high - low) // 8, low, (low + high) // 2,
                   high):
        best = _every_plan(view, options, budget)
        if best is None:
            continue
        sol = solve(step_graph, budget, offload=options, nest=False)
        assert sol.peak_bytes is not None and sol.peak_bytes <= budget
        assert _cost(view, options, sol) == best
        assert sol.offload is not None
        assert sol.offload.estimated_seconds == pytest.approx(options.seconds(best))


def test_transfers_a_layers_compute_hides_cost_nothing(step_graph):
    # 10 TB/s against 400 TFLOP/s: one byte each way is 40 FLOPs, well under a
    # layer's compute for what it offloads, so the overlap hides every transfer.
    fast = OffloadOptions(host_bandwidth=10**13)
    low = min_feasible_budget(step_graph, nest=False)
    sol = solve(step_graph, low, offload=fast, nest=False)
    assert sol.offload is not None and sol.offload.host_bytes > 0
    unhidden = fast.seconds(fast.cost_flops(sol.recompute_flops, sol.offload.host_bytes))
    assert sol.offload.estimated_seconds == pytest.approx(fast.seconds(sol.recompute_flops))
    assert sol.offload.estimated_seconds < unhidden
    # The link is cheap enough that offloading buys recomputation back.
    assert sol.recompute_flops < solve(step_graph, low, nest=False).recompute_flops
