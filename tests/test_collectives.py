"""Collectives a recomputation repeats: priced on the link, minimised with the FLOPs.

The graphs here are built by hand on a 2-device mesh, so each check runs a real
solve on one process's device; what the client measures of a sharded step's
collectives is checked on 8 simulated devices (``tests/mesh_checks.py``).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

import optiremat
from optiremat.cli import main
from optiremat.client.planfile import load_plan
from optiremat.solver import CostGraph, GraphBuilder
from optiremat.solver.collectives import flops_per_link_byte, priced
from optiremat.solver.graph import DeviceMesh
from optiremat.solver.offload import DEFAULT_DEVICE_FLOP_RATE, OffloadOptions
from optiremat.solver.solution import DEFAULT_INTERCONNECT_BANDWIDTH, SolveOptions
from optiremat.solver.solve import BudgetSeries, solve

MOVED = 1000  # bytes one device moves each time the gather runs


def two_ways(moved: int = MOVED) -> CostGraph:
    """Two values the backward pass reads, room to save one: a dot that costs 100 FLOPs
    to recompute and moves nothing, a gather that costs 10 and moves ``moved`` bytes."""
    b = GraphBuilder("two ways")
    b.mesh = DeviceMesh.of([("data", 2)])
    x = b.input(4)
    dot, gathered = b.value(8), b.value(8)
    b.node("dot_general", [x], [dot], key="dot", flops=100)
    b.node("reshape", [x], [gathered], key="gather", flops=10, collective_bytes=moved)
    b.backward_reads = [dot, gathered]
    return b.build()


ONE_SAVED = 4 + 8  # the input, which a recomputation reads, and one saved value


def test_a_collective_the_forward_paid_for_is_saved_though_it_costs_fewer_flops() -> None:
    answer = solve(two_ways(), ONE_SAVED)
    # The gather's 1000 bytes cost 8e6 FLOP-equivalents at the defaults: the plan saves it
    # and recomputes the dot, the more FLOPs but no link.
    assert answer.saved_keys == ["gather"]
    assert answer.recompute_flops == 100 and answer.collective_bytes == 0
    assert answer.lower_bound_flops == 100


def test_a_fast_enough_link_makes_recomputing_the_gather_the_cheaper_plan() -> None:
    fast = 10**17  # 2 devices * 4e14 FLOP/s over 1e17 B/s: a byte costs 0.008 FLOPs
    answer = solve(two_ways(), ONE_SAVED, interconnect_bandwidth=fast)
    assert answer.saved_keys == ["dot"]
    assert answer.recompute_flops == 10 and answer.collective_bytes == MOVED
    # The bound is on what the search minimises: FLOPs and the link's 8 FLOP-equivalents.
    assert answer.lower_bound_flops == 10 + 8
    assert answer.graph_hash == two_ways().content_hash


def test_the_link_is_priced_at_the_whole_mesh_s_flop_rate_rounded_up() -> None:
    graph = two_ways(moved=3)
    options = SolveOptions(interconnect_bandwidth=7)
    assert flops_per_link_byte(graph, options) == Fraction(2 * DEFAULT_DEVICE_FLOP_RATE, 7)
    view = priced(graph, options)
    assert view.node_flops == [100, 10 + -(-3 * 2 * DEFAULT_DEVICE_FLOP_RATE // 7)]
    assert view.node_collective_bytes is None  # folded in: a search prices it once
    offload = SolveOptions(offload=OffloadOptions(device_flop_rate=10**12))
    assert flops_per_link_byte(graph, offload) == Fraction(2 * 10**12,
                                                         DEFAULT_INTERCONNECT_BANDWIDTH)


def test_a_sweep_reports_what_a_solve_reports() -> None:
    series = BudgetSeries(two_ways(), SolveOptions())
    for budget in (ONE_SAVED, 4 + 8 + 8):
        swept, alone = series.solve(budget), solve(two_ways(), budget)
        assert swept.fingerprint() == alone.fingerprint()
        assert swept.collective_bytes == 0


def test_graphs_and_answers_without_collectives_keep_their_json() -> None:
    graph = two_ways(moved=0)
    assert graph.node_collective_bytes is None
    assert "node_collective_bytes" not in json.loads(graph.canonical_json())
    assert priced(graph, SolveOptions()) is graph
    answer = solve(graph, ONE_SAVED)
    assert answer.collective_bytes is None
    wire = json.loads(answer.model_dump_json())
    assert "collective_bytes" not in wire and "interconnect_bandwidth" not in wire["options"]
    assert CostGraph.model_validate_json(two_ways().canonical_json()) == two_ways()


@pytest.mark.parametrize("bandwidth", [0, -1, 2.5, 2**62])
def test_an_interconnect_bandwidth_that_is_not_a_positive_integer_is_refused(
        bandwidth: object) -> None:
    with pytest.raises(ValueError, match="interconnect_bandwidth"):
        solve(two_ways(), ONE_SAVED, interconnect_bandwidth=bandwidth)


def test_the_command_line_prices_the_link_it_is_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph_path, plan_path = tmp_path / "mesh.graph.json", tmp_path / "mesh.plan.json"
    graph_path.write_text(two_ways().canonical_json())
    assert main(["solve", str(graph_path), "--budget", str(ONE_SAVED), "-o", str(plan_path),
                 "--interconnect-bandwidth", "1e17"]) == 0
    solution = load_plan(plan_path).solution
    assert solution.saved_keys == ["dot"] and solution.collective_bytes == MOVED
    assert solution.options.interconnect_bandwidth == 10**17
    capsys.readouterr()
    assert main(["explain", str(plan_path)]) == 0
    assert "collectives its recomputation repeats: 1000 B per device" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["solve", str(graph_path), "--budget", str(ONE_SAVED),
              "--interconnect-bandwidth", "0"])
    assert "--interconnect-bandwidth: not a positive whole number" in capsys.readouterr().err


def test_a_server_prices_the_link_as_the_library_does(remote: optiremat.RematClient) -> None:
    for options in ({"time_limit_s": 20.0},
                    {"time_limit_s": 20.0, "interconnect_bandwidth": 10**17}):
        local = solve(two_ways(), ONE_SAVED, **options)
        answered = remote.solve(two_ways(), ONE_SAVED, **options)
        assert answered.fingerprint() == local.fingerprint()
        assert answered.collective_bytes == local.collective_bytes
