"""Folding repeated layers keeps every tied plan's cost, and so the tied optimum.

``optiremat.solver.repeats`` replaces copies 2 .. m-3 of a repeated layer by copy 1 with
its FLOPs and bytes multiplied. The claim is exactness for *every* tied decision
vector, which random stacks check plan by plan against the full graph, and
brute force over all key subsets checks for the optimum at every budget.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optiremat.solver import (
    CostGraph,
    GraphBuilder,
    InfeasibleBudgetError,
    max_useful_budget,
    min_feasible_budget,
    solve,
)
from optiremat.solver.repeats import Repeats, compress, find_repeats, why_not_folded
from optiremat.solver.semantics import baseline_backward_flops, evaluate
from optiremat.solver.synthetic import transformer_like

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# One op of a layer: (key, flops, output bytes, inputs), an input being "x" (the
# layer's input, the previous layer's last output), "p" (a parameter of its own),
# "s" (a parameter every layer shares, read by the backward pass) or the index
# of an earlier op of the layer.
Op = tuple[str, int, int, tuple[object, ...]]


@st.composite
def layers(draw: st.DrawFn) -> tuple[list[Op], set[int]]:
    ops: list[Op] = []
    for i in range(draw(st.integers(2, 5))):
        sources = st.sampled_from(["x", "p", "s", *range(i)])
        reads = tuple(draw(st.lists(sources, min_size=1, max_size=3, unique=True)))
        ops.append((draw(st.sampled_from("abcd")), draw(st.integers(0, 9)),
                    draw(st.integers(1, 9)), reads))
    # One op found once per layer, as real layers have: it shows the period.
    ops[-1] = ("z", *ops[-1][1:])
    backward_reads = set(draw(st.lists(st.integers(0, len(ops) - 1), max_size=3)))
    return ops, backward_reads


def stack(ops: list[Op], reads: set[int], copies: int) -> CostGraph:
    """``copies`` layers of ``ops`` between a one-node prefix and a one-node suffix."""
    b = GraphBuilder("stack")
    shared = b.input(2)
    b.backward_reads.append(shared)
    x = b.value(4)
    b.node("embed", [b.input(3)], [x], key="embed", flops=5)
    for _ in range(copies):
        own = b.input(3)
        outs: list[int] = []
        for i, (key, flops, nbytes, sources) in enumerate(ops):
            out = b.value(nbytes)
            ins = [x if s == "x" else own if s == "p" else shared if s == "s" else outs[s]
                   for s in sources]
            b.node("op", ins, [out], key=key, flops=flops)
            outs.append(out)
            if i in reads:
                b.backward_reads.append(out)
        x = outs[-1]
    loss = b.value(1)
    b.node("loss", [x], [loss], key="loss", flops=3)
    b.backward_reads.append(x)
    return b.build()


def cost(g: CostGraph, saved_keys: set[str]) -> tuple[int, int]:
    ev = evaluate(g, [k in saved_keys for k in g.node_key])
    return ev.residual_bytes, ev.backward_flops - baseline_backward_flops(g)


@PROPERTY
@given(layer=layers(), copies=st.integers(5, 7), seed=st.integers(0, 2**16))
def test_folded_graph_prices_every_tied_plan_like_the_full_one(
    layer: tuple[list[Op], set[int]], copies: int, seed: int
) -> None:
    g = stack(*layer, copies)
    folded = compress(g)
    assert folded is not None, why_not_folded(g, find_repeats(g) or _whole(g, copies))
    assert folded.graph.num_nodes < g.num_nodes
    keys = sorted({k for k in g.node_key if k})
    rng = random.Random(seed)
    for _ in range(8):
        saved = {k for k in keys if rng.random() < 0.5}
        full = [k in saved for k in g.node_key]
        assert folded.expand(folded.restrict(full)) == full
        assert cost(folded.graph, saved) == cost(g, saved)


def _whole(g: CostGraph, copies: int):  # only to name the reason in a failure message
    from optiremat.solver.repeats import Repeats

    return Repeats(1, (g.num_nodes - 2) // copies, copies)


@pytest.mark.parametrize("copies", [5, 8])
def test_tied_optimum_equals_brute_force_at_every_budget(copies: int) -> None:
    ops: list[Op] = [
        ("a", 4, 6, ("x", "p")),
        ("b", 9, 8, (0,)),
        ("c", 1, 2, (1, "s")),
        ("a", 4, 6, (2, "x")),
    ]
    g = stack(ops, {1, 2}, copies)
    assert compress(g) is not None
    keys = sorted({k for k in g.node_key if k})
    points = [cost(g, set(c)) for r in range(len(keys) + 1)
              for c in itertools.combinations(keys, r)]
    lowest = min(nbytes for nbytes, _ in points)
    assert min_feasible_budget(g) == lowest
    for budget in sorted({nbytes for nbytes, _ in points}):
        best = min(flops for nbytes, flops in points if nbytes <= budget)
        s = solve(g, budget)
        assert (s.status, s.recompute_flops) == ("optimal", best)
        assert s.residual_bytes <= budget
        assert len(s.node_decisions) == g.num_nodes
        assert cost(g, set(s.saved_keys)) == (s.residual_bytes, s.recompute_flops)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, lowest - 1)
    assert err.value.min_budget_bytes == lowest


def test_transformer_stack_folds_and_solves_like_the_direct_model() -> None:
    g = transformer_like(8)
    folded = compress(g)
    # The first layer reads a graph input where the others read a layer's output,
    # so it stays in the prefix; the other seven fold into two.
    assert folded is not None and folded.repeats.copies == 7
    assert folded.graph.num_nodes == g.num_nodes - 5 * folded.repeats.period
    for fraction in (0.3, 0.6):
        budget = int(max_useful_budget(g) * fraction)
        ours, direct = solve(g, budget), solve(g, budget, direct=True)
        assert ours.graph_hash == direct.graph_hash == g.content_hash
        assert (ours.recompute_flops, ours.status) == (direct.recompute_flops, "optimal")


def test_layers_reading_two_values_back_do_not_fold() -> None:
    ops: list[Op] = [("a", 4, 6, ("x", "p")), ("b", 9, 8, (0,))]
    g = stack(ops, set(), 6)
    assert compress(g) is not None
    # Each layer now also reads the layer input of the layer before: two values cross.
    b = GraphBuilder("skip")
    prev = x = b.input(4)
    for _ in range(6):
        h = b.value(6)
        b.node("op", [x, prev], [h], key="a", flops=4)
        out = b.value(6)
        b.node("op", [h], [out], key="b", flops=9)
        prev, x = x, out
    b.backward_reads.append(x)
    assert compress(b.build()) is None


def test_shared_parameter_not_read_by_the_backward_pass_blocks_folding() -> None:
    b = GraphBuilder("shared")
    shared, x = b.input(2), b.input(4)
    for _ in range(6):
        out = b.value(4)
        b.node("op", [x, shared], [out], key="a", flops=4)
        x = out
    b.backward_reads.append(x)
    g = b.build()
    assert find_repeats(g) is None
    b.backward_reads.append(shared)
    assert find_repeats(b.build()) is not None


def test_a_keyless_node_in_a_copy_blocks_folding() -> None:
    b = GraphBuilder("keyless")
    x = b.input(4)
    for _ in range(6):
        h, out = b.value(4), b.value(4)
        b.node("op", [x], [h], key="a", flops=4)
        b.node("op", [h], [out], key="", flops=4)
        x = out
    b.backward_reads.append(x)
    g = b.build()
    assert find_repeats(g) is None
    assert "without a policy key" in (why_not_folded(g, _copies_of_two(g)) or "")


def _copies_of_two(g: CostGraph):
    from optiremat.solver.repeats import Repeats

    return Repeats(0, 2, g.num_nodes // 2)


@pytest.mark.parametrize("bandwidth", [10**13, 10**9], ids=["cheap link", "dear link"])
def test_offload_solves_fold_too_and_keep_the_optimum(bandwidth: int) -> None:
    from optiremat.solver.offload import OffloadOptions

    g = transformer_like(6)
    assert compress(g) is not None
    budget = max_useful_budget(g) // 4
    options = dict(offload=OffloadOptions(host_bandwidth=bandwidth), time_limit_s=60)
    folded, direct = solve(g, budget, **options), solve(g, budget, direct=True, **options)
    assert folded.status == direct.status == "optimal"
    assert folded.offload is not None and direct.offload is not None
    assert folded.offload.estimated_seconds == direct.offload.estimated_seconds
    assert len(folded.node_decisions) == g.num_nodes
    assert folded.residual_bytes <= budget
    assert any(folded.offloaded()) == (bandwidth == 10**13)


def test_a_layers_parameter_read_after_the_stack_is_not_folded_into_the_others() -> None:
    """Every layer's parameter is read by the backward pass, and the loss also
    reads layer 3's. Folding that layer into the representative would count the
    parameter twice (scaled with the others, and again where the loss reads it)."""
    b = GraphBuilder("tied-weights")
    x, params = b.input(4), []
    for _ in range(8):
        p = b.input(3)
        params.append(p)
        b.backward_reads.append(p)
        h, out = b.value(5), b.value(4)
        b.node("op", [x, p], [h], key="a", flops=4)
        b.node("op", [h], [out], key="z", flops=7)
        x = out
    b.node("loss", [x, params[3]], [b.value(1)], key="loss", flops=1)
    b.backward_reads.append(x)
    g = b.build()
    folded = compress(g)
    if folded is not None:  # only copies that leave layer 3 alone may fold
        for saved in ({"a"}, {"z"}, {"a", "z", "loss"}, set()):
            assert cost(folded.graph, saved) == cost(g, saved)
    # Layers 1-6 as copies 0-5 (layer 0 reads a graph input; layer 7 is read by
    # the loss): layer 3's parameter is shared, so its layer differs from its twins.
    reason = why_not_folded(g, Repeats(2, 2, 6))
    assert reason == "node 6 in copy 2 is wired unlike its twin in copy 0"
