"""Reductions keep the optimum: reduced plans against every plan, and against the direct model.

``reduction.dominated_choices`` fixes decisions; the claim is that the best
FLOPs at every budget (the whole Pareto frontier) is unchanged. Brute force
checks that on small random graphs rich in what the rules look for (zero-FLOP
reshapes, zero-byte outputs, loop carries); the solver checks it against the
direct formulation on bigger ones.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optiremat.solver import (
    CostGraph,
    GraphBuilder,
    NodeMode,
    SolveStatus,
    max_useful_budget,
    solve,
)
from optiremat.solver.formulation import build
from optiremat.solver.reduction import bounds, dominated_choices
from optiremat.solver.semantics import baseline_backward_flops, evaluate
from optiremat.solver.synthetic import transformer_like

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def graphs(draw: st.DrawFn) -> CostGraph:
    """DAGs of up to 12 nodes; many are 0-FLOP one-in one-out nodes or write 0 bytes."""
    b = GraphBuilder("reductions")
    nbytes = st.integers(0, 40)
    inputs = [b.input(draw(nbytes)) for _ in range(draw(st.integers(1, 3)))]
    values, produced = list(inputs), []
    modes = st.sampled_from([NodeMode.FREE] * 8 + [NodeMode.SAVE, NodeMode.RECOMPUTE])
    size = {v: b.values[v][0] for v in values}
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["op", "reshape", "reshape", "empty"]))
        key = draw(st.sampled_from(["", "", "a", "b", "r"]))
        if kind == "reshape":
            src = draw(st.sampled_from(values))
            out = b.value(size[src] + draw(st.sampled_from([0, 0, 1, -1])) if size[src] else 0)
            b.node("reshape", [src], [out], key=key, mode=draw(modes))
            writes = [out]
        else:
            reads = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3, unique=True))
            count = draw(st.integers(1, 2))
            writes = [b.value(0 if kind == "empty" else draw(nbytes)) for _ in range(count)]
            b.node("op", reads, writes, key=key, flops=draw(st.integers(0, 30)), mode=draw(modes))
        for v in writes:
            size[v] = b.values[v][0]
        values += writes
        produced += writes
    b.backward_reads = draw(st.lists(st.sampled_from(values), min_size=1, max_size=5,
                                     unique=True))
    if draw(st.booleans()):
        b.carry_in = [inputs[0]]
        b.carry_out = [draw(st.sampled_from(produced))]
    return b.build()


def frontier(g: CostGraph, tie: bool, fixed: dict[int, bool]) -> dict[int, int]:
    """Best recompute FLOPs at each budget (every residual size some plan has),
    over all plans that respect ``fixed``."""
    groups: dict[str, list[int]] = {}
    for n in range(g.num_nodes):
        if g.node_mode[n] == NodeMode.FREE:
            groups.setdefault(g.node_key[n] if tie and g.node_key[n] else f"#{n}", []).append(n)
    baseline = baseline_backward_flops(g)
    best: dict[int, int] = {}
    for bits in itertools.product([False, True], repeat=len(groups)):
        saved = [False] * g.num_nodes
        for bit, nodes in zip(bits, groups.values(), strict=True):
            for n in nodes:
                saved[n] = bit
        if any(saved[n] != choice for n, choice in fixed.items()):
            continue
        ev = evaluate(g, saved)
        flops = ev.backward_flops - baseline
        best[ev.residual_bytes] = min(flops, best.get(ev.residual_bytes, flops))
    return best


def best_at(points: dict[int, int], budget: int) -> int | None:
    fits = [flops for nbytes, flops in points.items() if nbytes <= budget]
    return min(fits) if fits else None


def group_fixings(g: CostGraph, tie: bool) -> dict[int, bool]:
    """The fixings the formulation applies: a tied key only when all its nodes agree."""
    fixed = dominated_choices(g, bounds(g), tie)
    f = build(g, tie)
    out: dict[int, bool] = {}
    for nodes in f.decision_nodes:
        choices = {fixed.get(n) for n in nodes}
        if len(choices) == 1 and None not in choices:
            out.update({n: fixed[n] for n in nodes})
    return out


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@PROPERTY
@given(g=graphs())
def test_dominated_choices_keep_every_budgets_optimum(g: CostGraph, tie: bool) -> None:
    everything = frontier(g, tie, {})
    reduced = frontier(g, tie, group_fixings(g, tie))
    for budget in sorted(everything):
        assert best_at(reduced, budget) == best_at(everything, budget), budget


def test_the_rules_fire_on_a_reshape_chain_and_a_zero_byte_output() -> None:
    b = GraphBuilder()
    x = b.input(8)
    y, z, w, flag = b.value(8), b.value(8), b.value(16), b.value(0)
    b.node("reshape", [x], [y])  # 0 FLOPs from an input: recompute
    b.node("transpose", [y], [z])  # 0 FLOPs from a per-node decision: recompute
    b.node("exp", [z], [w], flops=10)  # real work: free
    b.node("iota", [], [flag], flops=3)  # writes 0 bytes: save
    b.backward_reads = [w, z, flag]
    g = b.build()
    assert dominated_choices(g, bounds(g), tie=False) == {0: False, 1: False, 3: True}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_reduced_and_direct_models_agree_on_a_transformer(tie: bool, fraction: float) -> None:
    g = transformer_like(3, seq=64, d_model=128, heads=4)
    budget = int(max_useful_budget(g) * fraction)
    reduced = solve(g, budget, tie=tie)
    direct = solve(g, budget, tie=tie, direct=True)
    assert reduced.status == direct.status == SolveStatus.OPTIMAL
    assert reduced.recompute_flops == direct.recompute_flops
    assert reduced.residual_bytes == direct.residual_bytes
