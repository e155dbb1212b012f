"""The solver against brute force over every decision vector, with real OR-Tools solves.

``semantics.evaluate`` is the definition of cost; brute force enumerates every
plan through it (tied: one bit per policy key, untied: one per free node), so a
solver optimum that differs from brute force means the MILP is not faithful.
"""

from __future__ import annotations

import itertools
import threading
import time
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optiremat.solver import (
    Backend,
    CostGraph,
    GraphBuilder,
    InfeasibleBudgetError,
    NodeMode,
    Solution,
    SolveOptions,
    SolveStatus,
    evaluate,
    max_useful_budget,
    min_feasible_budget,
    solve,
)
from optiremat.solver.formulation import build
from optiremat.solver.semantics import baseline_backward_flops
from optiremat.solver.synthetic import transformer_like

BACKENDS = [Backend.CPSAT, Backend.SCIP]
PROPERTY = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# ---- random graphs and brute force --------------------------------------------


@st.composite
def graphs(draw: st.DrawFn) -> CostGraph:
    """DAGs of up to 14 nodes: shared keys, forced modes, reads, maybe a carry pair."""
    b = GraphBuilder("random")
    nbytes = st.integers(0, 64)
    inputs = [b.input(draw(nbytes)) for _ in range(draw(st.integers(1, 3)))]
    values = list(inputs)
    produced: list[int] = []
    modes = st.sampled_from([NodeMode.FREE] * 6 + [NodeMode.SAVE, NodeMode.RECOMPUTE])
    for _ in range(draw(st.integers(1, 14))):
        reads = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True))
        writes = [b.value(draw(nbytes)) for _ in range(draw(st.integers(1, 2)))]
        b.node(
            "op",
            reads,
            writes,
            key=draw(st.sampled_from(["", "a", "b", "c"])),
            flops=draw(st.integers(0, 50)),
            mode=draw(modes),
        )
        values += writes
        produced += writes
    b.backward_reads = draw(st.lists(st.sampled_from(values), min_size=1, max_size=6,
                                     unique=True))
    if draw(st.booleans()):  # a loop body that reads its carry must rebuild it
        b.carry_in = [inputs[0]]
        b.carry_out = [draw(st.sampled_from(produced))]
    return b.build()


def plans(g: CostGraph, tie: bool) -> list[tuple[int, int]]:
    """(residual bytes, recompute FLOPs) of every decision vector."""
    free = [n for n in range(g.num_nodes) if g.node_mode[n] == NodeMode.FREE]
    groups: dict[str, list[int]] = {}
    for n in free:
        groups.setdefault(g.node_key[n] if tie and g.node_key[n] else f"#{n}", []).append(n)
    baseline = baseline_backward_flops(g)
    out = []
    for bits in itertools.product([False, True], repeat=len(groups)):
        saved = [False] * g.num_nodes
        for bit, nodes in zip(bits, groups.values(), strict=True):
            for n in nodes:
                saved[n] = bit
        ev = evaluate(g, saved)
        out.append((ev.residual_bytes, ev.backward_flops - baseline))
    return out


def optimum(all_plans: list[tuple[int, int]], budget: int) -> int | None:
    fits = [flops for nbytes, flops in all_plans if nbytes <= budget]
    return min(fits) if fits else None


def check_plan(g: CostGraph, s: Solution, budget: int, tie: bool) -> None:
    """Reported numbers are the exact evaluation of the reported decisions."""
    ev = evaluate(g, s.saved())
    assert s.residual_bytes == ev.residual_bytes <= budget
    assert s.recompute_flops == ev.backward_flops - baseline_backward_flops(g)
    assert 0 <= s.lower_bound_flops <= s.recompute_flops
    for n, mode in enumerate(g.node_mode):
        if mode != NodeMode.FREE:
            assert s.node_decisions[n] == mode.value
    if tie:
        by_key: dict[str, set[str]] = {}
        for n, mode in enumerate(g.node_mode):
            if mode == NodeMode.FREE and g.node_key[n]:
                by_key.setdefault(g.node_key[n], set()).add(s.node_decisions[n])
        assert all(len(d) == 1 for d in by_key.values()), "a key with two decisions"
        assert s.saved_keys == sorted(k for k, d in by_key.items() if d == {"save"})


def budgets(all_plans: list[tuple[int, int]]) -> st.SearchStrategy[int]:
    sizes = sorted({nbytes for nbytes, _ in all_plans})
    return st.one_of(st.sampled_from(sizes), st.integers(sizes[0], sizes[-1] + 5))


# ---- optimality and infeasibility ----------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(g=graphs(), data=st.data())
def test_optimum_equals_brute_force(g: CostGraph, data: st.DataObject, backend: Backend,
                                    tie: bool) -> None:
    all_plans = plans(g, tie)
    # direct=True solves the bare formulation, without reductions or start plans.
    direct = data.draw(st.booleans(), label="direct")
    for budget in data.draw(st.lists(budgets(all_plans), min_size=1, max_size=3)):
        s = solve(g, budget, backend=backend, tie=tie, direct=direct)
        assert s.status == SolveStatus.OPTIMAL
        assert s.recompute_flops == optimum(all_plans, budget)
        assert s.lower_bound_flops == s.recompute_flops and s.gap == 0.0
        check_plan(g, s, budget, tie)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(g=graphs())
def test_infeasible_budget_names_the_exact_minimum(g: CostGraph, backend: Backend,
                                                   tie: bool) -> None:
    smallest = min(nbytes for nbytes, _ in plans(g, tie))
    assert min_feasible_budget(g, tie=tie) == smallest
    if smallest == 0:
        return
    for direct in (False, True):
        with pytest.raises(InfeasibleBudgetError) as info:
            solve(g, smallest - 1, backend=backend, tie=tie, direct=direct)
        assert info.value.min_budget_bytes == smallest
        assert info.value.budget_bytes == smallest - 1
    check_plan(g, solve(g, smallest, backend=backend, tie=tie), smallest, tie)


@PROPERTY
@given(g=graphs(), data=st.data())
def test_untied_is_never_worse_than_tied(g: CostGraph, data: st.DataObject) -> None:
    budget = data.draw(budgets(plans(g, tie=True)))
    if budget < min_feasible_budget(g, tie=True):
        return
    tied, untied = solve(g, budget, tie=True), solve(g, budget, tie=False)
    assert untied.recompute_flops <= tied.recompute_flops


@PROPERTY
@given(g=graphs())
def test_max_useful_budget_buys_the_fewest_flops(g: CostGraph) -> None:
    save_all = evaluate(g, [True] * g.num_nodes)
    most = max_useful_budget(g)
    assert most == save_all.residual_bytes
    s = solve(g, most)
    assert s.recompute_flops == save_all.backward_flops - baseline_backward_flops(g)
    assert s.residual_bytes <= most


# ---- determinism and agreement ---------------------------------------------------


@cache
def layers(n: int) -> CostGraph:
    return transformer_like(n, batch=1, seq=128, d_model=256, heads=4)


def between(g: CostGraph, fraction: float, tie: bool = True) -> int:
    """A budget ``fraction`` of the way from the smallest feasible to saving everything."""
    low, high = min_feasible_budget(g, tie), max_useful_budget(g)
    return low + int((high - low) * fraction)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_solves_give_identical_fingerprints(backend: Backend, tie: bool) -> None:
    g = layers(3)
    budget = between(g, 0.5)
    first = solve(g, budget, backend=backend, tie=tie)
    assert first.status == SolveStatus.OPTIMAL
    for _ in range(2):
        assert solve(g, budget, backend=backend, tie=tie).fingerprint() == first.fingerprint()


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_backends_agree_on_the_optimum(fraction: float) -> None:
    g = layers(3)
    budget = between(g, fraction)
    cpsat, scip = (solve(g, budget, backend=b) for b in BACKENDS)
    assert cpsat.status == scip.status == SolveStatus.OPTIMAL
    assert cpsat.recompute_flops == scip.recompute_flops
    # Phase 2 makes the leanest plan among the optimal ones the answer.
    assert cpsat.residual_bytes == scip.residual_bytes


def test_plan_is_canonical_among_equal_flops_optima() -> None:
    """Two zero-FLOPs reshapes: recomputing them frees bytes at no cost."""
    b = GraphBuilder("reshapes")
    x = b.input(100)
    y = b.value(100)
    z = b.value(100)
    b.node("reshape", [x], [y], key="reshape", flops=0)
    b.node("reshape", [y], [z], key="reshape", flops=0)
    b.backward_reads += [x, z]
    g = b.build()
    s = solve(g, 1000)
    assert (s.recompute_flops, s.residual_bytes) == (0, 100)
    assert s.node_decisions == ["recompute", "recompute"] and s.saved_keys == []


# ---- solve() surface ---------------------------------------------------------------


def test_solution_reports_solver_and_options() -> None:
    g = layers(1)
    s = solve(g, max_useful_budget(g) // 2, SolveOptions(tie=False), backend="scip")
    assert s.solver == "scip" and s.solver_version
    assert s.options == SolveOptions(tie=False, backend=Backend.SCIP)
    assert s.graph_hash == g.content_hash
    assert len(s.node_decisions) == g.num_nodes
    assert s.saved_keys == []  # untied plans are delivered by name, not by key


def test_unknown_override_and_bad_budget_are_rejected() -> None:
    g = layers(1)
    with pytest.raises(ValueError, match="tie_breaker"):
        solve(g, 10, tie_breaker=True)
    with pytest.raises(ValueError, match="non-negative integer"):
        solve(g, -1)
    with pytest.raises(ValueError, match="non-negative integer"):
        solve(g, 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_progress_reports_improving_incumbents(backend: Backend) -> None:
    """CP-SAT reports each incumbent; SCIP at least the start plan."""
    g = layers(4)
    seen: list[tuple[int, int, float]] = []
    s = solve(g, between(g, 0.3), tie=False, backend=backend,
              progress=lambda inc, bound, t: seen.append((inc, bound, t)))
    assert seen
    incumbents = [inc for inc, _, _ in seen]
    assert incumbents == sorted(incumbents, reverse=True)
    assert all(bound <= inc for inc, bound, _ in seen)
    assert incumbents[-1] >= s.recompute_flops


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_returns_the_best_incumbent(backend: Backend) -> None:
    g = transformer_like(25)  # untied at half the bytes: minutes to prove optimal
    budget = max_useful_budget(g) // 2
    cancel = threading.Event()
    threading.Timer(1.5, cancel.set).start()
    started = time.monotonic()
    s = solve(g, budget, backend=backend, tie=False, cancel=cancel, time_limit_s=120)
    assert time.monotonic() - started < 30
    assert s.status in (SolveStatus.FEASIBLE, SolveStatus.OPTIMAL, SolveStatus.TIMED_OUT)
    if s.status != SolveStatus.TIMED_OUT:
        check_plan(g, s, budget, tie=False)


def test_cancel_before_start_returns_without_a_plan() -> None:
    g = layers(2)
    cancel = threading.Event()
    cancel.set()
    s = solve(g, max_useful_budget(g) // 2, cancel=cancel)
    assert s.status == SolveStatus.TIMED_OUT and s.node_decisions == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_byte_counts_stay_exact(backend: Backend) -> None:
    """Sizes near 2**50 with odd offsets: SCIP's floats must not leak into the answer."""
    b = GraphBuilder("huge")
    prev = b.input(2**50 + 1)
    for i in range(12):
        out = b.value(2**50 + 2 * i + 1)
        b.node("tanh", [prev], [out], key=f"t{i % 3}", flops=1000 + i)
        b.backward_reads.append(out)
        prev = out
    g = b.build()
    all_plans = plans(g, tie=True)
    for budget in sorted({nbytes for nbytes, _ in all_plans})[1:4]:
        for probe in (budget - 1, budget):
            if probe < min(nbytes for nbytes, _ in all_plans):
                continue
            s = solve(g, probe, backend=backend)
            assert s.recompute_flops == optimum(all_plans, probe)
            check_plan(g, s, probe, tie=True)


# ---- the model reads like the graph ----------------------------------------------


def test_variables_are_named_after_keys_nodes_and_values() -> None:
    g = layers(1)
    tied, untied = build(g, tie=True), build(g, tie=False)
    assert any(name.startswith("save[key dot_general(") for name in tied.var_names)
    assert any(name.startswith("save[node ") for name in untied.var_names)
    assert any(name.startswith("needed[value ") for name in tied.var_names)
    assert any(name.startswith("active[node ") and "exp" in name for name in tied.var_names)
    assert any(name.startswith("residual[value ") for name in tied.var_names)
    assert len(set(tied.var_names)) == len(tied.var_names)


def test_values_no_plan_needs_get_no_variables() -> None:
    """A branch the backward pass never reads, even through recomputes, is not modelled."""
    b = GraphBuilder("dead branch")
    x = b.input(8)
    used, dead, deader = b.value(8), b.value(8), b.value(8)
    b.node("sin", [x], [used], key="sin", flops=1)
    b.node("cos", [x], [dead], key="cos", flops=1)
    b.node("exp", [dead], [deader], key="exp", flops=1)
    b.backward_reads.append(used)
    f = build(b.build(), tie=True)
    assert f.var_names == (
        "save[key sin]", "needed[value 0]", "active[node 0 sin]", "residual[value 1]"
    )
    assert f.decision_nodes == ((0,),)
