"""One plan and one frontier over the three levers: recomputation per layer, nested
groups and offload, priced in estimated seconds (``optiremat.solver.nesting``)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import optiremat
from optiremat.client.frontier import graph_builtin_points, lever_floors, sweep
from optiremat.client.peak.step_graph import step_extraction
from optiremat.client.plot import plot_frontier
from optiremat.client.step import Step
from optiremat.solver.graph import CostGraph
from optiremat.solver.nesting import candidate_groups, forward_flops
from optiremat.solver.offload import OffloadOptions
from optiremat.solver.solution import InfeasibleBudgetError
from optiremat.solver.solve import max_useful_budget, min_feasible_budget, solve
from tests.peak_models import residual_stack

# A link fast enough that offloading the layer inputs pays, slow enough that it is not
# free: the frontier of the 64-layer stack then uses every lever.
LINK = OffloadOptions(host_bandwidth=10**12, host_budget_bytes=2**30)


@pytest.fixture(scope="module")
def stack() -> CostGraph:
    fun, args = residual_stack(layers=64)
    return step_extraction(fun, args, Step.of(0), name_inputs=True).graph


def _seconds(graph: CostGraph, budget: int, groups: tuple[int, ...]) -> float | None:
    """One lever alone: per layer with offload, or nested groups without."""
    nested = any(k != 1 for k in groups)
    try:
        sol = solve(graph, budget, offload=None if nested else LINK, groups=groups)
    except InfeasibleBudgetError:
        return None
    if sol.offload is not None:
        return sol.offload.estimated_seconds
    # A solve with its groups fixed leaves out the groups' second forward pass.
    return (sol.recompute_flops + forward_flops(graph, groups)) / LINK.device_flop_rate


def test_a_plan_is_the_lever_that_adds_the_fewest_seconds(stack):
    low = min_feasible_budget(stack, offload=LINK)
    high = max_useful_budget(stack)
    assert low < min_feasible_budget(stack)  # offload reaches below any nesting
    seen = set()
    for budget in (low, low + (high - low) // 10, (low + high) // 3, high):
        sol = solve(stack, budget, offload=LINK)
        each = [s for g in candidate_groups(stack)
                if (s := _seconds(stack, budget, g)) is not None]
        assert sol.offload is not None and sol.peak_bytes is not None
        assert sol.peak_bytes <= budget
        assert sol.offload.estimated_seconds == pytest.approx(min(each), rel=1e-12)
        assert sol.options.offload == LINK
        seen.add("nested" if sol.groups else "offload" if sol.offload.host_bytes else "remat")
    assert {"nested", "offload"} <= seen


def test_the_frontier_over_every_lever_is_peak_against_seconds(stack, tmp_path: Path):
    floors = lever_floors(stack, offload=LINK)
    assert floors == [min_feasible_budget(stack), min_feasible_budget(stack, nest=False)]
    assert lever_floors(stack) == []  # without offload the sweep starts at the smallest anyway
    frontier = sweep(stack, count=8, also=floors, offload=LINK)
    at_floor = [p for p in frontier.points if p.budget_bytes == floors[0]]
    assert at_floor and at_floor[0].groups  # where nesting starts to fit, it is the plan
    assert frontier.min_feasible_budget == min_feasible_budget(stack, offload=LINK)
    assert frontier.step_seconds is not None and frontier.step_seconds > 0
    plans = frontier.plans
    assert all(p.estimated_seconds is not None and p.host_bytes is not None for p in plans)
    assert any(p.host_bytes for p in plans) and any(p.groups for p in plans)
    for p in plans:
        beaten = any(q.memory_bytes <= p.memory_bytes and q.estimated_seconds <= p.estimated_seconds
                     and (q.memory_bytes, q.estimated_seconds) != (p.memory_bytes,
                                                                    p.estimated_seconds)
                     for q in plans)
        assert p.pareto == (not beaten)

    svg = plot_frontier(frontier, tmp_path / "levers.svg", builtins=graph_builtin_points(stack))
    text = svg.read_text()
    for label in ("plans: offload", "plans: nested groups", "best nested form",
                  "nothing_saveable per layer", "estimated step time"):
        assert label in text


def test_an_offload_request_answered_by_nested_groups_applies_with_equal_gradients():
    fun, args = residual_stack(layers=16, d=64, batch=256)
    graph = step_extraction(fun, args, Step.of(0), name_inputs=True).graph
    want = jax.grad(fun)(*args)
    offloaded = optiremat.optimize(fun, *args, budget=min_feasible_budget(graph, offload=LINK),
                                   offload=LINK)
    nested = optiremat.optimize(fun, *args, budget=min_feasible_budget(graph), offload=LINK)
    assert offloaded.host_bytes > 0 and set(offloaded.groups) == {1}
    assert nested.host_bytes == 0 and max(nested.groups) > 1
    assert "  offload" not in nested.explain()  # no offload lever where nothing left
    for plan in (offloaded, nested):
        got = jax.jit(jax.grad(plan.apply(fun)))(*args)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
