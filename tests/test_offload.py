"""Offload as a third choice: real CP-SAT solves against brute force, real JAX traces.

Cheap transfers make the plan offload, dear ones make it recompute; the policy's
``Offloadable`` answers are checked against the jaxpr JAX builds with them: the
``device_put`` copies to host are exactly the plan's offloaded values, and the
residuals left on the device match the plan byte for byte.
"""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction

import pytest
from pydantic import ValidationError

from solver import GraphBuilder, InfeasibleBudgetError, NodeMode, SolveOptions, solve
from solver.graph import CostGraph
from solver.offload import DEFAULT_HOST_BANDWIDTH, OffloadOptions
from solver.offload_solve import evaluate_offload
from solver.semantics import baseline_backward_flops

CHEAP = OffloadOptions(host_bandwidth=10**18)  # a byte costs far less than a FLOP
DEAR = OffloadOptions(host_bandwidth=1)  # a byte costs 4e14 FLOPs


def chain(layers: int = 4, nbytes: int = 1000, flops: int = 10**6) -> CostGraph:
    """x -> tanh -> tanh -> ...; the backward pass reads every activation."""
    b = GraphBuilder("chain")
    prev = b.input(nbytes)
    for i in range(layers):
        h = b.value(nbytes)
        b.node("tanh", [prev], [h], key=f"k{i}", flops=flops)
        b.backward_reads.append(h)
        prev = h
    return b.build()


def cost(graph: CostGraph, sol) -> Fraction:
    assert sol.options.offload is not None and sol.offload is not None
    return sol.options.offload.cost_flops(sol.recompute_flops, sol.offload.host_bytes)


# ---- the solver ----------------------------------------------------------------


def test_cheap_transfers_offload_dear_ones_recompute() -> None:
    g = chain()
    cheap = solve(g, 1000, offload=CHEAP)
    assert cheap.offloaded_keys == ["k0", "k1", "k2"] and cheap.saved_keys == ["k3"]
    assert cheap.recompute_flops == 0
    assert (cheap.residual_bytes, cheap.offload.host_bytes) == (1000, 3000)
    assert cheap.offload.transfer_bytes == 6000  # out and back
    assert cheap.node_decisions == ["offload", "offload", "offload", "save"]

    dear = solve(g, 1000, offload=DEAR)
    assert dear.offloaded_keys == [] and dear.offload.host_bytes == 0
    assert dear.recompute_flops == 3 * 10**6
    assert dear.node_decisions.count("recompute") == 3
    assert dear.offload.estimated_seconds == pytest.approx(3e6 / 4e14)


def test_a_host_budget_of_zero_offloads_nothing() -> None:
    g = chain()
    none = solve(g, 1000, offload=OffloadOptions(host_bandwidth=10**18, host_budget_bytes=0))
    plain = solve(g, 1000)
    assert none.offloaded_keys == [] and none.offload.host_bytes == 0
    assert none.recompute_flops == plain.recompute_flops
    # A host budget for one value offloads one value.
    one = solve(g, 1000, offload=OffloadOptions(host_bandwidth=10**18, host_budget_bytes=1000))
    assert len(one.offloaded_keys) == 1 and one.offload.host_bytes == 1000


def test_an_infeasible_device_budget_names_the_smallest_one() -> None:
    g = chain()
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 999, offload=OffloadOptions(host_budget_bytes=0))
    assert err.value.min_budget_bytes == 1000
    # With host memory, the device may hold nothing: offload h1 and h3, rebuild the rest.
    assert solve(g, 0, offload=OffloadOptions(host_budget_bytes=2000)).residual_bytes == 0


@pytest.mark.parametrize("bad", [
    {"host_bandwidth": 0}, {"device_flop_rate": -1}, {"host_budget_bytes": -1},
    {"host_bandwidth": 2.5}, {"bandwidth": 10},
])
def test_bad_options_are_rejected_clearly(bad: dict) -> None:
    with pytest.raises(ValidationError) as err:
        SolveOptions.model_validate({"offload": bad})
    assert next(iter(bad)) in str(err.value)


def test_prices_that_overflow_64_bits_are_rejected() -> None:
    g = chain(flops=10**15)
    odd = OffloadOptions(host_bandwidth=10**18 + 9, device_flop_rate=10**15 + 7)
    with pytest.raises(ValueError, match="64-bit"):
        solve(g, 1000, offload=odd)


def test_options_without_offload_keep_their_json_and_hash() -> None:
    plain = SolveOptions()
    assert "offload" not in plain.model_dump(mode="json")
    on = SolveOptions(offload=OffloadOptions())
    assert on.model_dump(mode="json")["offload"] == {
        "host_budget_bytes": 64 * 2**30, "host_bandwidth": DEFAULT_HOST_BANDWIDTH,
        "device_flop_rate": 400 * 10**12}
    sol = solve(chain(), 1000)
    assert "offload" not in json.loads(sol.model_dump_json())


def test_the_same_request_gives_the_same_plan() -> None:
    g = chain(6)
    options = OffloadOptions(host_bandwidth=10**9, device_flop_rate=10**12)
    runs = {solve(g, 2000, offload=options).fingerprint() for _ in range(3)}
    assert len(runs) == 1


def _random_graph(seed: int) -> CostGraph:
    rnd = random.Random(seed)
    b = GraphBuilder(f"random {seed}")
    values = [b.input(rnd.randrange(0, 64)) for _ in range(rnd.randint(1, 2))]
    for _ in range(rnd.randint(2, 8)):
        reads = rnd.sample(values, min(len(values), rnd.randint(1, 2)))
        writes = [b.value(rnd.randrange(0, 64)) for _ in range(rnd.randint(1, 2))]
        mode = rnd.choice([NodeMode.FREE] * 5 + [NodeMode.SAVE, NodeMode.RECOMPUTE])
        b.node("op", reads, writes, key=f"k{rnd.randrange(5)}" if mode == NodeMode.FREE else "",
               flops=rnd.randrange(0, 100), mode=mode)
        values.extend(writes)
        b.backward_reads.extend(v for v in writes if rnd.random() < 0.4)
    if not b.backward_reads:
        b.backward_reads.append(values[-1])
    return b.build()


def _brute_force(g: CostGraph, budget: int, options: OffloadOptions) -> Fraction | None:
    """Least cost over every (recompute, save, offload) choice per key."""
    keys = sorted({k for k, m in zip(g.node_key, g.node_mode, strict=True) if m == "free"})
    base = baseline_backward_flops(g)
    best = None
    for choice in itertools.product((0, 1, 2), repeat=len(keys)):
        of = dict(zip(keys, choice, strict=True))
        saves = [of.get(k, 0) > 0 for k in g.node_key]
        offloaded = [m == "free" and of.get(k) == 2
                     for k, m in zip(g.node_key, g.node_mode, strict=True)]
        plan = evaluate_offload(g, saves, offloaded)
        if plan.device_bytes <= budget and plan.host_bytes <= options.host_budget_bytes:
            c = options.cost_flops(plan.evaluation.backward_flops - base, plan.host_bytes)
            best = c if best is None or c < best else best
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_optimum_is_brute_forces(seed: int) -> None:
    g = _random_graph(seed)
    rnd = random.Random(seed)
    options = OffloadOptions(host_budget_bytes=rnd.randrange(0, 150),
                             host_bandwidth=rnd.choice([1, 3, 7, 10**6]),
                             device_flop_rate=rnd.choice([1, 2, 5]))
    budget = rnd.randrange(0, 150)
    best = _brute_force(g, budget, options)
    if best is None:
        with pytest.raises(InfeasibleBudgetError):
            solve(g, budget, offload=options)
        return
    sol = solve(g, budget, offload=options)
    assert cost(g, sol) == best
    plan = evaluate_offload(g, [d != "recompute" for d in sol.node_decisions],
                            [d == "offload" for d in sol.node_decisions])
    assert (plan.device_bytes, plan.host_bytes) == (sol.residual_bytes, sol.offload.host_bytes)
    assert sol.residual_bytes <= budget and sol.offload.host_bytes <= options.host_budget_bytes
