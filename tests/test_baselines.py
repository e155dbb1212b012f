"""Baselines on the graph: JAX's built-ins agree with JAX, none beats the optimum."""

from __future__ import annotations

import pytest

from optiremat.solver import GraphBuilder, max_useful_budget, min_feasible_budget, solve
from optiremat.solver.baselines import (
    builtin_offered_saves,
    compare,
    greedy_saves,
    offered_saves,
    policy_saves,
)
from optiremat.solver.semantics import evaluate
from optiremat.solver.synthetic import transformer_like


@pytest.fixture(scope="module")
def stack():
    return transformer_like(3, seq=64, d_model=128, heads=4)


@pytest.mark.parametrize("name", ["mlp", "transformer_block", "conv_net"])
def test_builtins_on_the_graph_cost_what_jax_measures(name: str) -> None:
    from optiremat.client import extract_graph
    from optiremat.client.frontier import builtin_points
    from tests.models import CORPUS

    fun, args = CORPUS[name]
    graph = extract_graph(fun, *args)
    ours = {b.name: (b.residual_bytes, b.recompute_flops) for b in compare(graph, 0, 0)}
    for policy, point in builtin_points(fun, *args).items():
        if policy in ours:  # no batch-dims column from extraction: that one is left out
            assert ours[policy] == (point.residual_bytes, point.recompute_flops), policy


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_no_baseline_within_budget_beats_the_optimum(stack, fraction: float) -> None:
    low, high = min_feasible_budget(stack), max_useful_budget(stack)
    budget = low + int((high - low) * fraction)
    solution = solve(stack, budget, compare_baselines=True)
    assert solution.baselines is not None
    names = {b.name for b in solution.baselines}
    assert names == {"everything_saveable", "nothing_saveable", "dots_saveable",
                     "dots_with_no_batch_dims_saveable", "greedy_knapsack"}
    for b in solution.baselines:
        assert b.extra_flops == b.recompute_flops - solution.recompute_flops
        if b.fits_budget:
            assert b.extra_flops >= 0, b.name
    greedy = next(b for b in solution.baselines if b.name == "greedy_knapsack")
    assert greedy.fits_budget


def test_builtin_extremes_and_the_batch_dims_column(stack) -> None:
    saves = policy_saves(stack)
    assert evaluate(stack, saves["everything_saveable"]).residual_bytes == \
        max_useful_budget(stack)
    no_batch = saves["dots_with_no_batch_dims_saveable"]
    assert sum(no_batch) < sum(saves["dots_saveable"])  # attention's batched dots recompute

    b = GraphBuilder()
    x = b.input(8)
    y = b.value(8)
    b.node("dot_general", [x], [y], flops=5)
    b.backward_reads = [y]
    graph = b.build()
    assert graph.node_batch_dims is None
    assert "dots_with_no_batch_dims_saveable" not in policy_saves(graph)
    assert "node_batch_dims" not in graph.canonical_json()  # old graphs keep their hash


def test_a_policy_is_offered_only_the_nodes_with_a_policy_key() -> None:
    b = GraphBuilder()
    x = b.input(8)
    y, z, w = b.value(8), b.value(8), b.value(8)
    b.node("dot_general", [x], [y], flops=5, key="dot")
    b.node("dot_general", [y], [z], flops=5)  # no key: no policy is asked about it
    b.node("sin", [z], [w], flops=1, key="sin")
    b.backward_reads = [y, z, w]
    graph = b.build()
    assert offered_saves(graph, [True, True, False]) == [True, False, False]
    offered = builtin_offered_saves(graph)
    assert offered.keys() == policy_saves(graph).keys()
    assert offered["everything_saveable"] == [True, False, True]
    assert offered["dots_saveable"] == [True, False, False]
    assert not any(offered["nothing_saveable"])


def test_greedy_is_the_empty_plan_when_nothing_fits(stack) -> None:
    nothing = evaluate(stack, [False] * stack.num_nodes).residual_bytes
    assert not any(greedy_saves(stack, nothing - 1))


def test_solutions_without_baselines_keep_their_json(stack) -> None:
    solution = solve(stack, max_useful_budget(stack) // 2)
    assert solution.baselines is None
    assert "baselines" not in solution.model_dump()
