"""The frontier sweep and its plot: plans as a staircase, JAX's built-ins as points."""

from __future__ import annotations

import struct
from fractions import Fraction
from pathlib import Path

import pytest

import optiremat
from optiremat.client.frontier import builtin_points, graph_builtin_points, spaced_budgets, sweep
from optiremat.client.peak.priced import cheapest_priced, priced_cost
from optiremat.client.plot import plot_frontier, plot_function
from optiremat.solver.solve import max_useful_budget, min_feasible_budget
from tests.models import CORPUS


def test_sweep_spans_feasible_budgets_and_marks_the_pareto_plans() -> None:
    fun, args = CORPUS["transformer_block"]
    graph = optiremat.extract_graph(fun, *args)
    result = sweep(graph, count=5)
    low, high = min_feasible_budget(graph), max_useful_budget(graph)
    assert (result.min_feasible_budget, result.max_useful_budget) == (low, high)
    assert [p.budget_bytes for p in result.points] == spaced_budgets(low, high, 5)
    plans = result.plans
    assert all(p.residual_bytes <= p.budget_bytes for p in plans)
    flops = [p.recompute_flops for p in sorted(plans, key=lambda p: p.budget_bytes)]
    assert flops == sorted(flops, reverse=True) and flops[-1] == 0
    assert all(p.pareto for p in plans if p.recompute_flops == min(flops))

    below = sweep(graph, budgets=[low - 1, low])
    assert below.points[0].status == "infeasible" and below.points[0].min_budget_bytes == low


@pytest.mark.parametrize("name", ["mlp", "scan_stack", "cond"])
def test_builtins_a_graph_determines_match_what_jax_measures(name: str) -> None:
    fun, args = CORPUS[name]
    measured = builtin_points(fun, *args)
    from_graph = graph_builtin_points(optiremat.extract_graph(fun, *args))
    assert from_graph == {k: measured[k] for k in from_graph}


def image_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_is_a_valid_png_or_svg(tmp_path: Path) -> None:
    fun, args = CORPUS["scan_stack"]
    png = plot_function(fun, *args, path=tmp_path / "frontier.png", points=4, save_price=1.0)
    width, height = image_size(png)
    assert (width, height) == (900, 576)  # 7.5 x 4.8 inches at 120 dpi

    graph = optiremat.extract_graph(fun, *args)
    svg = plot_frontier(sweep(graph, count=3), tmp_path / "frontier.svg",
                        builtins=graph_builtin_points(graph))
    text = svg.read_text()
    assert "<svg" in text and "everything_saveable" in text

    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        plot_frontier(sweep(graph, count=2), tmp_path / "frontier.pdf")


def test_the_priced_plan_is_marked_where_recompute_and_saved_bytes_cost_least(
        tmp_path: Path) -> None:
    fun, args = CORPUS["transformer_block"]
    graph = optiremat.extract_graph(fun, *args)
    frontier = sweep(graph, count=6)
    plans = frontier.plans
    # Free saves: the plan recomputing least (of those, the fewest bytes); saves dearer
    # than any FLOP: the plan saving least.
    free = cheapest_priced(plans, Fraction(0))
    assert free is not None and free.recompute_flops == min(p.recompute_flops or 0
                                                            for p in plans)
    assert free.residual_bytes == min(p.residual_bytes or 0 for p in plans
                                      if p.recompute_flops == free.recompute_flops)
    dear = cheapest_priced(plans, Fraction(10**12))
    assert dear is not None and dear.residual_bytes == min(p.residual_bytes or 0 for p in plans)
    # At a price between: no plan costs less than the one marked.
    flops = {p.budget_bytes: p.recompute_flops or 0 for p in plans}
    price = Fraction(max(flops.values()), 2 * max(p.residual_bytes or 0 for p in plans))
    chosen = cheapest_priced(plans, price)
    assert chosen is not None
    assert all(priced_cost(chosen, price) <= priced_cost(p, price) for p in plans)

    svg = plot_frontier(frontier, tmp_path / "priced.svg", save_price=0.5)
    assert "least FLOPs + 0.5 x saved bytes" in svg.read_text()
    for bad in (-1, float("nan"), "cheap", True):
        with pytest.raises(ValueError, match=r"save_price= takes the FLOPs one saved byte"):
            plot_frontier(frontier, tmp_path / "bad.svg", save_price=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"save_price= takes the FLOPs one saved byte"):
            plot_function(fun, *args, path=tmp_path / "bad.svg", save_price=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "bad.svg").exists()
